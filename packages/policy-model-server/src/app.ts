/**
 * The policy model server: the proxy, the policy gate and — with `checkpoint_policy: true` and
 * checkpointing on — the model participant and its control routes; with token capture on, the
 * capture ledger and its control routes.
 */
import { createHttpClients } from '@ckpt-gym/core/client';
import {
  AdmissionClosedError,
  ConfigError,
  InvalidRequestError,
  InvalidRolloutIdError,
} from '@ckpt-gym/core/protocol';
import {
  createGymApp,
  type ControlPlane,
  gymRoute,
  type GymRoute,
  type Logger,
  mountRoutes,
  type ServerSettings,
  type StackSettings,
  bearerAuth,
  createLogger,
  type WorkerLink,
} from '@ckpt-gym/core/server';
import express, { type ErrorRequestHandler, type Express, type Router } from 'express';

import { type PolicyModelConfig, policyModelConfig } from './config.js';
import { GenerationCuts } from './cuts.js';
import { PolicyGate } from './gate.js';
import { CaptureLedger } from './ledger.js';
import { type ModelRecord, PolicyParticipant } from './participant.js';
import { createProxyRouter } from './proxy.js';
import { PolicyWorker } from './worker.js';

export const CAPTURE_CONTROL_PREFIX = '/training-token-capture/control';
export const MAX_REMOVAL_BATCH = 4096;

export interface PolicyModelServer {
  readonly app: Express;
  readonly logger: Logger;
  readonly gate: PolicyGate;
  /** Present when this server is a checkpoint participant. */
  readonly participant: PolicyParticipant | undefined;
  readonly plane: ControlPlane<ModelRecord> | undefined;
  /** Present when token capture is on. */
  readonly ledger: CaptureLedger | undefined;
  readonly config: PolicyModelConfig;
  /** In a worker of a server with several workers: its share of the participant, to attach. */
  readonly worker: PolicyWorker | undefined;
}

export interface PolicyModelOptions {
  logger?: Logger;
  /**
   * In a worker of a server with several workers: its link to the coordinator. The worker then
   * has no participant of its own; its control routes forward to the coordinator.
   */
  link?: WorkerLink | undefined;
}

/** Builds the server's express app (listen on it with core's `listen`). */
export async function createPolicyModelServer(
  server: ServerSettings,
  stack: StackSettings,
  options: PolicyModelOptions = {},
): Promise<PolicyModelServer> {
  if (server.kind !== 'model') {
    throw new ConfigError(`servers.${server.name}: a policy model server must be kind: model`);
  }
  const config = policyModelConfig(server);
  const ledger = stack.tokenCapture.enabled
    ? await new CaptureLedger(stack.tokenCapture.dir).init()
    : undefined;
  const joins = stack.checkpoint !== undefined && config.checkpointPolicy;

  const logger = options.logger ?? createLogger({ server: server.name, kind: 'model' });
  let cuts: GenerationCuts | undefined;
  if (config.checkpointGenerationCuts && joins && ledger) {
    cuts = new GenerationCuts({
      serverName: server.name,
      url: config.generationCutControlUrl,
      token: stack.checkpoint!.controlAuthToken,
      control: createHttpClients().control,
      logger,
    });
  } else if (config.checkpointGenerationCuts) {
    logger.warn(
      'checkpoint_generation_cuts needs checkpoint_policy, checkpointing and token capture on; cuts are off',
    );
  }

  let participant: PolicyParticipant | undefined;
  let worker: PolicyWorker | undefined;
  const gate = new PolicyGate(() => participant?.changed());
  if (joins && options.link) {
    worker = new PolicyWorker({ policy: gate, link: options.link, ledger, cuts, logger });
  } else if (joins) {
    participant = new PolicyParticipant(server.name, gate, ledger, cuts);
  }

  const gym = createGymApp<ModelRecord>({
    name: server.name,
    kind: 'model',
    checkpoint: joins ? stack.checkpoint : undefined,
    participant,
    ...(worker && options.link ? { control: options.link.controlTarget() } : {}),
    logger,
  });
  const hooks = participant ?? worker;

  const token = config.captureControlToken ?? stack.checkpoint?.controlAuthToken;
  if (ledger && token !== undefined) {
    gym.app.use(CAPTURE_CONTROL_PREFIX, captureControlRouter(ledger, gate, token));
  }
  gym.app.use(
    createProxyRouter({
      backendUrl: config.backendUrl,
      forwardRolloutPrefix: config.forwardRolloutPrefix,
      backendApiKey: config.backendApiKey,
      gate,
      ledger,
      cuts,
      ...(hooks ? { afterAdmit: hooks.afterAdmit.bind(hooks) } : {}),
      ...(worker ? { onUnusedCut: worker.giveBack.bind(worker) } : {}),
      logger: gym.logger,
    }),
  );
  gym.finish();
  return {
    app: gym.app,
    logger: gym.logger,
    gate,
    participant,
    plane: gym.plane,
    ledger,
    config,
    worker,
  };
}

/** The ids of a removal body: `{"rollout_ids": [1..4096 strings]}`, nothing else. */
export function removalIds(body: unknown): string[] {
  if (typeof body !== 'object' || body === null || Array.isArray(body)) {
    throw new InvalidRequestError('body: must be an object with rollout_ids');
  }
  const { rollout_ids: ids, ...extra } = body as Record<string, unknown>;
  const unknownKeys = Object.keys(extra);
  if (unknownKeys.length > 0)
    throw new InvalidRequestError(`body: unknown keys ${unknownKeys.join(', ')}`);
  if (
    !Array.isArray(ids) ||
    ids.length < 1 ||
    ids.length > MAX_REMOVAL_BATCH ||
    !ids.every((id) => typeof id === 'string')
  ) {
    throw new InvalidRequestError(
      `rollout_ids: must be a list of 1 to ${MAX_REMOVAL_BATCH} strings`,
    );
  }
  return ids as string[];
}

/**
 * The training framework's ledger cleanup routes. Retire and delete are refused while a checkpoint
 * is open here: a commit reads the ledger of every episode it continues, and a removal landing
 * between prepare and commit would leave the checkpoint an episode without lineage.
 */
function captureControlRouter(ledger: CaptureLedger, gate: PolicyGate, token: string): Router {
  const router = express.Router();
  router.use(bearerAuth(token));
  const removal = (op: 'retire' | 'delete'): GymRoute =>
    gymRoute({
      method: 'post',
      path: `/rollouts/${op}`,
      episode: 'none',
      body: { limit: '4mb', parse: removalIds },
      run: ({ body: ids }) => {
        if (!gate.accepting) {
          throw new AdmissionClosedError(
            'a checkpoint is open on this model server; retry ledger retire and delete after it resumes',
          );
        }
        return op === 'retire' ? ledger.retire(ids) : ledger.delete(ids);
      },
    });
  mountRoutes(router, [
    gymRoute({
      method: 'get',
      path: '/rollouts/:id/manifest',
      episode: 'none',
      run: ({ req }) => ledger.manifest(String(req.params.id)),
    }),
    removal('retire'),
    removal('delete'),
  ]);
  router.use(undecodableIdError);
  return router;
}

/**
 * Express refuses a path parameter that is not percent-encoded UTF-8 (`%ZZ`) before the route runs,
 * with a URIError (core's 422 `invalid_request` for any path parameter): this parameter is a
 * rollout id, and such an id names no rollout, a 400 like any other invalid id.
 */
const undecodableIdError: ErrorRequestHandler = (err, _req, _res, next) => {
  next(
    err instanceof URIError
      ? new InvalidRolloutIdError('the rollout id in the path is not percent-encoded UTF-8')
      : err,
  );
};
