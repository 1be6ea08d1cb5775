import { SERVER_GLIBC_TUNABLE, serverEnv } from '../src/launcher.js';

describe('serverEnv', () => {
  test("a server's malloc runs on transparent huge pages: the tunable is added to an environment without one", () => {
    const env = { PATH: '/usr/bin' };
    expect(serverEnv(env)).toEqual({ PATH: '/usr/bin', GLIBC_TUNABLES: SERVER_GLIBC_TUNABLE });
    expect(env).toEqual({ PATH: '/usr/bin' }); // the caller's environment is not changed
  });

  test("the user's own glibc tunables are kept, the server's added after them", () => {
    const env = { GLIBC_TUNABLES: 'glibc.malloc.trim_threshold=1048576' };
    expect(serverEnv(env).GLIBC_TUNABLES).toBe(
      `glibc.malloc.trim_threshold=1048576:${SERVER_GLIBC_TUNABLE}`,
    );
  });

  test('a user who sets the huge-page tunable themselves keeps their value', () => {
    const env = { GLIBC_TUNABLES: 'glibc.malloc.mmap_threshold=65536:glibc.malloc.hugetlb=0' };
    expect(serverEnv(env)).toBe(env);
  });
});
