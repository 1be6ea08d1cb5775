/**
 * An agent server of several workers in this process, as `ckpt-gym serve` runs one across
 * processes: the agent coordinator behind its control plane on a Unix socket, and each worker a
 * Simple Agent app with its session router on its own socket and its link to the coordinator,
 * listening on a port of its own (so a test picks the worker a request lands on).
 */
import { mkdtempSync, rmSync } from 'node:fs';
import { join } from 'node:path';

import {
  ControlPlane,
  createLogger,
  listen,
  type ListeningServer,
  newRoutingId,
  planeTarget,
  serveCoordinator,
  WorkerLink,
} from '@ckpt-gym/core/server';
import { closeNow, type StubModel, type StubToolResources } from '@ckpt-gym/testing';

import type { AgentDefinition } from '../../src/agent.js';
import { type AgentServer, createAgentServer } from '../../src/app.js';
import { agentCoordinator } from '../../src/kind.js';
import { AgentParticipant } from '../../src/participant.js';
import { simpleAgent } from '../../src/simple-agent.js';
import { CHECKPOINT } from './harness.js';

export interface AgentWorker {
  readonly url: string;
  readonly routingId: string;
  readonly agent: AgentServer<unknown>;
  readonly participant: AgentParticipant;
}

export interface AgentWorkers extends AsyncDisposable {
  /** The checkpoint directory root (shared with the stubs' harness). */
  readonly dir: string;
  readonly workers: readonly AgentWorker[];
  /** A crash: every worker and the coordinator gone, nothing left on their sockets. */
  close(): Promise<void>;
}

const quiet = () => createLogger({ server: 'agent', kind: 'agent', level: 'error' });

export async function startAgentWorkers(
  base: { model: StubModel; resources: StubToolResources; dir: string },
  count = 2,
  definition: AgentDefinition<unknown> = simpleAgent as AgentDefinition<unknown>,
): Promise<AgentWorkers> {
  const logger = quiet();
  const runtimeDir = mkdtempSync('/tmp/cga-');
  const coordinator = agentCoordinator({
    instance: 'simple_agent',
    expectedWorkers: count,
    logger,
  });
  const plane = new ControlPlane(coordinator, { leaseGraceSeconds: 600, logger });
  const socketPath = join(runtimeDir, 'coordinator.sock');
  const server = await serveCoordinator(coordinator, planeTarget(plane), socketPath, logger);
  const started: { agent: AgentServer<unknown>; link: WorkerLink; http: ListeningServer }[] = [];
  const workers: AgentWorker[] = [];
  for (let index = 1; index <= count; index += 1) {
    const routingId = newRoutingId();
    const link = new WorkerLink({
      socketPath,
      index,
      logger,
      label: 'agent',
      onCoordinatorLost: () => undefined,
    });
    const agent = createAgentServer(definition, {
      name: 'simple_agent',
      checkpoint: CHECKPOINT,
      config: { model_server_url: base.model.url, resources_server_url: base.resources.url },
      logger,
      routing: { routingId, socketDir: runtimeDir },
      link,
    });
    await agent.router!.listen(agent.app);
    await link.attach(agent.worker!);
    const http = await listen(agent.app, 0);
    started.push({ agent, link, http });
    workers.push({
      url: http.url,
      routingId,
      agent,
      participant: agent.participant as AgentParticipant,
    });
  }
  const close = async () => {
    for (const { agent, link, http } of started) {
      await closeNow(http);
      await agent.router!.close();
      await link.detach();
      agent.close();
    }
    plane.dispose();
    await server.close();
    rmSync(runtimeDir, { recursive: true, force: true });
  };
  return { dir: base.dir, workers, close, [Symbol.asyncDispose]: close };
}
