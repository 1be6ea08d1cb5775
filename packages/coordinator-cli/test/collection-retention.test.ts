/** Checkpoint retention: the newest two published checkpoints stay, and nothing else. */
import { entriesToRemove } from '../src/collection/retention.js';

const published = (name: string, createdAt: number) => ({ name, isDirectory: true, createdAt });

test('every published checkpoint but the newest two goes, whatever the listing order', () => {
  const entries = [
    published('ckpt-c', 30),
    published('ckpt-a', 10),
    published('ckpt-d', 40),
    published('ckpt-b', 20),
  ];
  expect(entriesToRemove(entries).sort()).toEqual(['ckpt-a', 'ckpt-b']);
  expect(entriesToRemove(entries.slice(0, 2))).toEqual([]);
});

test('partial checkpoints and dot files go; the log, LATEST and other directories stay', () => {
  const entries = [
    published('ckpt-new', 5),
    { name: 'ckpt-partial', isDirectory: true },
    { name: 'c1', isDirectory: true },
    { name: '.LATEST.123.tmp', isDirectory: false },
    { name: 'LATEST', isDirectory: false },
    { name: 'dispatched.jsonl', isDirectory: false },
  ];
  expect(entriesToRemove(entries).sort()).toEqual(['.LATEST.123.tmp', 'ckpt-partial']);
});
