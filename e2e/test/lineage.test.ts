/**
 * Token lineage across a crash (counter stack, token capture on): the replacement's first call
 * names the checkpointed call as its parent, and a checkpoint restored a second time, after its
 * replacement made calls and every gym process crashed, keeps none of the dead run's calls.
 */
import { ep } from '@ckpt-gym/testing';

import { closeAll, type CallView, Deployment, scenario } from './support/deployment.js';
import { counterEpisode, TOKEN } from './support/stacks.js';

afterEach(closeAll);

interface Admission {
  rollout_id: string;
  model_call_id: string;
  parent_call_id: string | null;
}

interface LedgerManifest {
  records: { model_call_id: string }[];
  failures: unknown[];
}

function admission(call: CallView | undefined): Admission {
  if (!call?.admission) throw new Error(`call ${call?.index} carries no capture admission`);
  return call.admission as Admission;
}

async function manifest(dep: Deployment, key: string): Promise<LedgerManifest> {
  return dep.clients
    .data(`${dep.url('policy')}/training-token-capture/control/rollouts/${key}/manifest`, {
      headers: { authorization: `Bearer ${TOKEN}` },
      retry: { limit: 0 },
    })
    .json<LedgerManifest>();
}

/** Counter rollout `r` held at its second call, checkpointed as c1, crashed and restored. */
async function checkpointAndRestore(dep: Deployment, rollout: string, restoreId = 'r1') {
  await dep.backend('/_ctl/hold', { after_calls: 1 });
  dep.post('env', '/run', counterEpisode(rollout));
  await dep.waitForCalls(2);
  await dep.checkpoint('c1', [ep(rollout)]);
  await dep.crashAndRestore('c1', [ep(rollout)], { restoreId });
}

scenario(
  'token lineage continues across a crash: the first replacement call names the checkpointed call',
  async () => {
    const dep = await Deployment.start('counter', { tokenCapture: true });
    await checkpointAndRestore(dep, 'counter-1');
    const reply = await dep.post('env', '/run', counterEpisode('counter-1', 1)).reply;
    expect(reply.body.result).toMatchObject({ reward: 1 });

    const calls = await dep.calls();
    const call0 = admission(calls[0]);
    const call1 = admission(calls[1]);
    const first = admission(calls[2]);
    expect(first.rollout_id).toBe('counter-1-a1');
    expect(first.parent_call_id).toBe(call0.model_call_id);
    const chain = (await manifest(dep, 'counter-1-a1')).records.map((r) => r.model_call_id);
    expect(chain[0]).toBe(call0.model_call_id);
    // The undelivered call was never in custody.
    expect(chain).not.toContain(call1.model_call_id);
    expect((await manifest(dep, 'counter-1-a1')).failures).toEqual([]);
  },
);

scenario(
  'a checkpoint restores again after its replacement made calls: none of the dead run is kept',
  async () => {
    const dep = await Deployment.start('counter', { tokenCapture: true });
    await checkpointAndRestore(dep, 'again-1');
    const dead = await dep.post('env', '/run', counterEpisode('again-1', 1)).reply;
    expect(dead.body.result).toMatchObject({ reward: 1 });
    const deadCalls = (await dep.calls()).slice(2).map((c) => admission(c).model_call_id);
    expect(deadCalls.length).toBeGreaterThan(0);

    // Every gym process dies before the next checkpoint: the same checkpoint restores again.
    const before = await dep.callCount();
    await dep.crashAndRestore('c1', [ep('again-1')], { restoreId: 'r2' });
    const reply = await dep.post('env', '/run', counterEpisode('again-1', 1)).reply;
    expect(reply.status).toBe(200);
    expect(reply.body.result).toMatchObject({ reward: 1, count: 6 });

    const calls = await dep.calls();
    // The second run continues from the checkpoint's boundary: the same calls as the dead run.
    expect(calls.slice(before).map((c) => c.n_messages)).toEqual([3, 5]);
    const call0 = admission(calls[0]);
    expect(admission(calls[before]).parent_call_id).toBe(call0.model_call_id);
    const ledger = await manifest(dep, 'again-1-a1');
    const chain = ledger.records.map((r) => r.model_call_id);
    expect(chain[0]).toBe(call0.model_call_id);
    expect(chain.filter((id) => deadCalls.includes(id))).toEqual([]);
    expect(ledger.failures).toEqual([]);
  },
);
