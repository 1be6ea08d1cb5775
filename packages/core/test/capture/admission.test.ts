import { parseCaptureAdmission, rootCaptureAdmission } from '../../src/capture/index.js';
import { STAGING_SCHEMA_VERSION } from '../../src/capture/hashes.js';

describe('rootCaptureAdmission', () => {
  test('is a valid parentless text admission of the current staging schema', () => {
    const admission = rootCaptureAdmission('r1-a2', 'call-1');
    expect(parseCaptureAdmission(admission)).toBe(admission);
    expect(admission).toMatchObject({
      schema_version: STAGING_SCHEMA_VERSION,
      rollout_id: 'r1-a2',
    });
    expect([admission.model_call_id, admission.parent_call_id, admission.generation_cut]).toEqual([
      'call-1',
      null,
      null,
    ]);
  });

  test('a fresh object each call: a caller that extends one never changes another', () => {
    const a = rootCaptureAdmission('r', 'c1');
    a.required_prefix_token_ids.push(1);
    expect(rootCaptureAdmission('r', 'c1').required_prefix_token_ids).toEqual([]);
  });
});
