/**
 * A checkpoint whose opaque payload is corrupt but that the store accepts: each record of a
 * participant's state is written again with the store (so digest, count and manifest are right),
 * one episode's field replaced by text that is not JSON. Restores that decode on use take it; the
 * first use of that episode must fail with a typed error. (No participant writes manifest extras;
 * the copy has none.)
 */
import { readFile } from 'node:fs/promises';
import { join } from 'node:path';

import { encodeJson, type JsonObject } from '@ckpt-gym/core/protocol';
import {
  type CheckpointRecord,
  participantDir,
  RECORD_FIELDS_JSON,
  writeParticipantState,
} from '@ckpt-gym/core/server';

export interface CorruptedCopy {
  /** The checkpoint directory to copy from, and the one to write. */
  from: string;
  to: string;
  kind: string;
  instance: string;
  checkpointId: string;
  /** The rollout whose record has its field replaced. */
  rollout: string;
  field: string;
  /** What the field's value becomes, as text (e.g. `{"a":tru}`). */
  text: string;
}

export async function writeCorruptedCopy(copy: CorruptedCopy): Promise<void> {
  const dir = participantDir(copy.from, copy.kind, copy.instance);
  const manifest = JSON.parse(await readFile(join(dir, 'manifest.json'), 'utf8')) as JsonObject;
  const text = await readFile(join(dir, manifest.records_file as string), 'utf8');
  const records = text
    .split('\n')
    .filter((line) => line.length > 0)
    .map((line) => corrupted(JSON.parse(line) as CheckpointRecord, copy));
  await writeParticipantState({
    checkpointDir: copy.to,
    kind: copy.kind,
    instance: copy.instance,
    checkpointId: copy.checkpointId,
    records,
  });
}

function corrupted(record: CheckpointRecord, copy: CorruptedCopy): CheckpointRecord {
  if (record.episode_id.rollout_id !== copy.rollout) return record;
  const { episode_id: _, ...fields } = record;
  const pieces = Object.entries(fields).map(
    ([name, value], i) =>
      `${i === 0 ? '' : ','}${encodeJson(name)}:${name === copy.field ? copy.text : encodeJson(value as JsonObject)}`,
  );
  return { ...record, [RECORD_FIELDS_JSON]: pieces };
}
