import { ParticipantStorage } from '../../src/control/storage.js';
import { hashThreadStarted } from '../../src/hash-thread.js';
import { readParticipantState, writeParticipantState } from '../../src/store.js';
import { TestParticipant } from '../support/test-participant.js';

describe('ParticipantStorage', () => {
  // One file, one process: the hashing thread is the process's, so the order of these two matters.
  test('a storage with injected store functions starts no hashing thread', () => {
    const write: typeof writeParticipantState = async () => Promise.reject(new Error('unused'));
    new ParticipantStorage(new TestParticipant(), {
      storage: { write, read: readParticipantState },
    });
    expect(hashThreadStarted()).toBe(false);
  });

  test("a process that commits through the store starts its hashing thread before its first commit, so no commit pays the thread's start", () => {
    new ParticipantStorage(new TestParticipant(), {});
    expect(hashThreadStarted()).toBe(true);
  });
});
