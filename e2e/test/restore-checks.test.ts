/**
 * Restore refuses a checkpoint whose participants disagree, before anything is installed, on the
 * whole stack with real processes: the counter server's directory taken from a later real
 * checkpoint of the same rollout. Without the check the restore succeeded and the counter
 * rollouts then finished with reward 0.
 */
import { cp, rm } from 'node:fs/promises';
import { join } from 'node:path';

import { restore, resume } from '@ckpt-gym/core/client';
import { CheckpointStateError } from '@ckpt-gym/core/protocol';
import { participantDir } from '@ckpt-gym/core/server';
import { deadline, ep, tracked } from '@ckpt-gym/testing';

import { closeAll, Deployment, scenario } from './support/deployment.js';
import { counterEpisode } from './support/stacks.js';

afterEach(closeAll);

scenario(
  "the counter server's directory from a later checkpoint is refused; the untampered one restores",
  async () => {
    const dep = await Deployment.start('counter');
    await dep.backend('/_ctl/hold', { after_calls: 1 });
    dep.post('env', '/run', counterEpisode('counter-1'));
    await dep.waitForCalls(2);
    await dep.checkpoint('c1', [ep('counter-1')]);
    await dep.resume('c1');
    await dep.checkpoint('c2', [ep('counter-1')]);
    await dep.resume('c2');

    const tampered = dep.checkpointDir('c1-tampered');
    await cp(dep.checkpointDir('c1'), tampered, { recursive: true });
    const counter = participantDir(tampered, 'resources', 'counter');
    await rm(counter, { recursive: true });
    await cp(participantDir(dep.checkpointDir('c2'), 'resources', 'counter'), counter, {
      recursive: true,
    });

    await dep.crash();
    await dep.backend('/_ctl/release', {});
    await dep.restart();
    const participants = dep.participants();
    const scope = [ep('counter-1')];
    const refused = await restore(participants, 'back', tampered, scope, deadline(30)).catch(
      (err: unknown) => err,
    );
    expect(refused).toBeInstanceOf(CheckpointStateError);
    expect(refused).toMatchObject({ code: 'invalid_checkpoint_state', status: 422 });
    expect((refused as Error).message).toMatch(
      new RegExp(`^${join(counter, 'manifest.json')} names checkpoint "c2", but .* names "c1"`),
    );
    // Every participant idle, nothing installed, no retire marks.
    expect(tracked(await dep.statuses())).toEqual({});

    await restore(participants, 'back', dep.checkpointDir('c1'), scope, deadline(30));
    await resume(participants, 'back', deadline(30));
    const reply = await dep.post('env', '/run', counterEpisode('counter-1', 1)).reply;
    expect(reply.status).toBe(200);
    expect(reply.body.result).toMatchObject({ reward: 1, count: 6 });
  },
);
