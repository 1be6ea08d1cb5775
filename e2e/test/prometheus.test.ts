/**
 * A real Prometheus (Debian's `prometheus` package; `.ci/run` installs it) scraping every server
 * of a native stack: the test runs it on a free port with its own storage, takes a checkpoint
 * while rollouts are in flight, and asks Prometheus's HTTP API for each participant's checkpoint
 * durations and the records and bytes it wrote, under the server's name and kind. Skipped, with a
 * message, only when no prometheus binary can be found.
 */
import { type ChildProcess, spawn } from 'node:child_process';
import { accessSync, constants, readFileSync, writeFileSync } from 'node:fs';
import { mkdtemp, rm } from 'node:fs/promises';
import { tmpdir } from 'node:os';
import { delimiter, join } from 'node:path';
import { fileURLToPath } from 'node:url';

import { freePort } from '@ckpt-gym/coordinator-cli';
import { ep, until } from '@ckpt-gym/testing';

import { closeAll, Deployment, scenario } from './support/deployment.js';
import { weatherEpisode } from './support/stacks.js';

/** `PROMETHEUS_BIN`, else the first `prometheus` on PATH or in /usr/bin. */
function findPrometheus(): string | undefined {
  const candidates = [
    ...(process.env.PROMETHEUS_BIN ? [process.env.PROMETHEUS_BIN] : []),
    ...(process.env.PATH ?? '').split(delimiter).map((dir) => join(dir, 'prometheus')),
    '/usr/bin/prometheus',
  ];
  return candidates.find((path) => {
    try {
      accessSync(path, constants.X_OK);
      return true;
    } catch {
      return false;
    }
  });
}

const PROMETHEUS = findPrometheus();
if (PROMETHEUS === undefined) {
  process.stderr.write(
    'prometheus.test.ts SKIPPED: no prometheus binary (set PROMETHEUS_BIN, or install it: ' +
      'apt-get install -y prometheus; .ci/run does)\n',
  );
}

interface Vector {
  metric: Record<string, string>;
  value: [number, string];
}

/** A Prometheus server on a free loopback port, scraping `targets` every second. */
class Prometheus {
  private constructor(
    readonly url: string,
    private readonly child: ChildProcess,
    private readonly dir: string,
  ) {}

  static async start(binary: string, targets: readonly string[]): Promise<Prometheus> {
    const dir = await mkdtemp(join(tmpdir(), 'ckpt-gym-prometheus-'));
    const config = join(dir, 'prometheus.yml');
    writeFileSync(
      config,
      [
        'global:',
        '  scrape_interval: 1s',
        '  scrape_timeout: 1s',
        '  evaluation_interval: 1s',
        'scrape_configs:',
        '  - job_name: ckpt-gym',
        '    static_configs:',
        `      - targets: [${targets.map((t) => `'${t}'`).join(', ')}]`,
        '',
      ].join('\n'),
    );
    const port = await freePort('127.0.0.1');
    const child = spawn(
      binary,
      [
        `--config.file=${config}`,
        `--storage.tsdb.path=${join(dir, 'data')}`,
        `--web.listen-address=127.0.0.1:${port}`,
      ],
      { detached: true, stdio: 'ignore' },
    );
    const prometheus = new Prometheus(`http://127.0.0.1:${port}`, child, dir);
    running.add(prometheus);
    await until(
      async () => (await fetch(`${prometheus.url}/-/ready`).catch(() => null))?.ok === true,
      'prometheus to be ready',
      60_000,
    );
    return prometheus;
  }

  /** An instant query's vector. */
  async query(expr: string): Promise<Vector[]> {
    const reply = await fetch(`${this.url}/api/v1/query?query=${encodeURIComponent(expr)}`);
    const body = (await reply.json()) as { status: string; data: { result: Vector[] } };
    if (body.status !== 'success') throw new Error(`query ${expr}: ${JSON.stringify(body)}`);
    return body.data.result;
  }

  /** Kills its process group and removes its storage. */
  async stop(): Promise<void> {
    running.delete(this);
    if (this.child.pid !== undefined && this.child.exitCode === null) {
      const exited = new Promise((resolve) => this.child.once('exit', resolve));
      process.kill(-this.child.pid, 'SIGKILL');
      await exited;
    }
    await rm(this.dir, { recursive: true, force: true });
  }
}

const running = new Set<Prometheus>();
afterEach(async () => {
  await Promise.all([...running].map((p) => p.stop()));
  await closeAll();
});

/** Each series of `vector` by its `server` label, as numbers. */
function byServer(vector: Vector[]): Record<string, number> {
  return Object.fromEntries(vector.map((v) => [v.metric.server, Number(v.value[1])]));
}

const ROLLOUTS = ['prom-1', 'prom-2', 'prom-3'];

const DASHBOARD = fileURLToPath(new URL('../../examples/grafana-dashboard.json', import.meta.url));

interface Panel {
  type: string;
  title: string;
  datasource?: { uid: string };
  targets?: { expr: string; datasource: { uid: string } }[];
}

/** The dashboard's queries as Prometheus gets them once Grafana filled in its variables. */
function dashboardQueries(): { title: string; expr: string }[] {
  const dashboard = JSON.parse(readFileSync(DASHBOARD, 'utf8')) as {
    templating: { list: { name: string; type: string; query: unknown }[] };
    panels: Panel[];
  };
  // The datasource is a variable, so the dashboard imports into any Grafana's Prometheus.
  expect(dashboard.templating.list[0]).toMatchObject({
    name: 'datasource',
    type: 'datasource',
    query: 'prometheus',
  });
  const queries = dashboard.panels
    .filter((panel) => panel.type !== 'row')
    .flatMap((panel) => {
      expect([panel.title, panel.datasource?.uid]).toEqual([panel.title, '${datasource}']);
      return (panel.targets ?? []).map((target) => {
        expect(target.datasource.uid).toBe('${datasource}');
        const expr = target.expr
          .replaceAll('$__rate_interval', '1m')
          .replaceAll('$__range', '1h')
          .replaceAll('$server', '.*');
        return { title: panel.title, expr };
      });
    });
  expect(queries.length).toBeGreaterThan(0);
  return queries;
}

(PROMETHEUS === undefined ? describe.skip : describe)('a real Prometheus', () => {
  scenario(
    "scrapes every participant's checkpoint durations, records and bytes, under its server and kind",
    async () => {
      const dep = await Deployment.start('native');
      const servers = dep.gymServers();
      const prometheus = await Prometheus.start(
        PROMETHEUS!,
        servers.map((s) => new URL(s.url).host),
      );

      // Scraped before the checkpoint: every series is there at 0 (or a first commit would be a
      // series born at 1, which no rate() sees).
      const names = servers.map((s) => s.name).sort();
      const commits = 'gym_checkpoint_operation_duration_ms_count{operation="commit",outcome="ok"}';
      const scrapedAt = async (count: number) => {
        const counts = byServer(await prometheus.query(commits));
        return names.every((name) => counts[name] === count);
      };
      await until(() => scrapedAt(0), 'a first scrape of every server', 60_000);

      // Three rollouts in flight, each held at its first model call, checkpointed there.
      await dep.backend('/_ctl/hold', { after_calls: 0 });
      const runs = ROLLOUTS.map((r) => dep.post('env', '/run', weatherEpisode(r)));
      await dep.waitForCalls(ROLLOUTS.length);
      const { committed } = await dep.checkpoint(
        'c1',
        ROLLOUTS.map((r) => ep(r)),
      );
      expect(committed.env?.episode_ids).toEqual(ROLLOUTS);

      await until(() => scrapedAt(1), 'a scrape of every participant after the commit', 60_000);

      const durations = await prometheus.query(commits);
      expect(durations.map((v) => [v.metric.server, v.metric.kind]).sort()).toEqual(
        servers.map((s) => [s.name, s.kind]).sort(),
      );
      expect(Object.values(byServer(durations))).toEqual(names.map(() => 1));
      const stages = byServer(
        await prometheus.query(
          'gym_checkpoint_stage_duration_ms_count{operation="commit",stage="records_write"}',
        ),
      );
      expect(Object.keys(stages).sort()).toEqual(names);
      const prepares = await prometheus.query(
        'gym_checkpoint_operation_duration_ms_count{operation="prepare",outcome="ok"}',
      );
      expect(prepares.map((v) => v.metric.server).sort()).toEqual(names);

      // What each participant's manifest says it wrote is what its counters say.
      const records = byServer(
        await prometheus.query('gym_checkpoint_records_total{operation="commit"}'),
      );
      const bytes = byServer(
        await prometheus.query('gym_checkpoint_bytes_total{operation="commit"}'),
      );
      const manifests = Object.fromEntries(
        names.map((name) => {
          const manifest = committed[name]?.manifest as {
            record_count: number;
            records_bytes: number;
          };
          return [name, [manifest.record_count, manifest.records_bytes]];
        }),
      );
      expect(Object.fromEntries(names.map((n) => [n, [records[n], bytes[n]]]))).toEqual(manifests);
      expect(records.env).toBe(ROLLOUTS.length);

      // Every query of the example dashboard is valid PromQL; its checkpoint duration and call
      // panels show this stack's participants.
      const answered: Record<string, Vector[]> = {};
      for (const { title, expr } of dashboardQueries()) {
        answered[title] = [...(answered[title] ?? []), ...(await prometheus.query(expr))];
      }
      const shown = (title: string, labels: Record<string, string> = {}) =>
        (answered[title] ?? [])
          .filter((v) => Object.entries(labels).every(([k, l]) => v.metric[k] === l))
          .filter((v) => Number.isFinite(Number(v.value[1])))
          .map((v) => v.metric.server)
          .sort();
      const commitLabels = { operation: 'commit' };
      expect(shown('Checkpoint operation duration (p99)', commitLabels)).toEqual(names);
      expect(shown('Checkpoint operation duration (mean per operation)', commitLabels)).toEqual(
        names,
      );
      // The agent reports sessions at a boundary and waiting calls, no calls in flight.
      expect(shown('Calls in flight')).toEqual(
        servers
          .filter((s) => s.kind !== 'agent')
          .map((s) => s.name)
          .sort(),
      );
      const inFlight = byServer(await prometheus.query('gym_calls{state="in_flight"}'));
      expect(inFlight.env).toBe(ROLLOUTS.length);
      expect(shown('Requests by route and status').length).toBeGreaterThan(0);

      await dep.resume('c1');
      await dep.backend('/_ctl/release', {});
      for (const run of runs) expect((await run.reply).status).toBe(200);
    },
    240_000,
  );
});
