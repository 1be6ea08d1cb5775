/**
 * The store as the plane uses it: bound to its participant (kind, instance, manifest extras,
 * record validation), its signing key and its file modes, so a commit writes and a restore reads
 * with only a directory, a checkpoint id and a scope.
 */
import { startHashThread } from '../hash-thread.js';
import type { Participant } from '../participant.js';
import {
  type CheckpointRecord,
  type Manifest,
  readParticipantState,
  readRawParticipantState,
  type WriteStop,
  writeParticipantState,
} from '../store.js';

/** The store functions the plane writes and reads through (injectable for tests). */
export interface ControlStorage {
  write: typeof writeParticipantState;
  read: typeof readParticipantState;
  /** Used for participants with `validateRawRecord`; without it they are read through `read`. */
  readRaw?: typeof readRawParticipantState;
}

export interface ParticipantStorageOptions {
  storage?: ControlStorage;
  /** `checkpoint.signing_key`: commits sign their manifests, restores refuse unsigned ones. */
  signingKey?: Uint8Array;
  /** `checkpoint.file_mode` / `dir_mode`: the modes a commit writes with (the store's defaults). */
  fileMode?: number;
  dirMode?: number;
}

export class ParticipantStorage<R extends CheckpointRecord> {
  readonly #participant: Participant<R>;
  readonly #storage: ControlStorage;
  readonly #options: ParticipantStorageOptions;

  constructor(participant: Participant<R>, options: ParticipantStorageOptions) {
    this.#participant = participant;
    this.#storage = options.storage ?? {
      write: writeParticipantState,
      read: readParticipantState,
      readRaw: readRawParticipantState,
    };
    this.#options = options;
    // This process commits: its first commit must not pay the hashing thread's start.
    if (this.#storage.write === writeParticipantState) startHashThread();
  }

  /** Writes the records, then the manifest (with the participant's extras, asked now). */
  write(
    checkpointDir: string,
    checkpointId: string,
    records: R[],
    stop: WriteStop,
  ): Promise<Manifest> {
    return this.#storage.write({
      checkpointDir,
      kind: this.#participant.kind,
      instance: this.#participant.instance,
      checkpointId,
      records,
      manifestExtra: this.#participant.manifestExtra(),
      signingKey: this.#options.signingKey,
      fileMode: this.#options.fileMode,
      dirMode: this.#options.dirMode,
      stop,
    });
  }

  /**
   * Reads and verifies the checkpoint, validating and keeping only the records in scope: undecoded
   * when the participant validates raw records (and the storage can read them so).
   */
  read(
    checkpointDir: string,
    scopeKeys: ReadonlySet<string>,
  ): Promise<{ manifest: Manifest; records: R[] }> {
    const participant = this.#participant;
    const common = {
      checkpointDir,
      kind: participant.kind,
      instance: participant.instance,
      select: (key: string) => scopeKeys.has(key),
      signingKey: this.#options.signingKey,
    };
    const readRaw = this.#storage.readRaw;
    if (participant.validateRawRecord !== undefined && readRaw !== undefined) {
      const validateRaw = participant.validateRawRecord.bind(participant);
      return readRaw<R>({ ...common, validate: validateRaw });
    }
    return this.#storage.read<R>({
      ...common,
      validate: (record, key) => participant.validateRecord(record, key),
    });
  }
}
