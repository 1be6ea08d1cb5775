/* global Buffer */
// A local OTLP/HTTP sink for benchmarks with tracing on: answers every export 200 and counts the
// spans it was sent, so a run can tell its servers really traced (and how many spans a rollout
// makes). It runs in the bench's process, on the cores the servers share, where a real collector
// runs elsewhere: so it counts without parsing, one substring search per span over the raw
// OTLP/JSON bytes (parsing every export took the stack's CPU and was measured as tracing's cost).
import { once } from 'node:events';
import { createServer } from 'node:http';

/** A key that OTLP/JSON writes once per span (events and links have no start time). */
const SPAN_KEY = Buffer.from('"startTimeUnixNano":');

/** How many spans an OTLP/JSON export body holds. */
export function countSpans(body) {
  let spans = 0;
  for (let at = body.indexOf(SPAN_KEY); at !== -1; at = body.indexOf(SPAN_KEY, at + 1)) spans++;
  return spans;
}

/** Listens on a free loopback port; `url` is the traces endpoint to hand the servers. */
export async function otlpSink() {
  let spans = 0;
  const server = createServer((req, res) => {
    const chunks = [];
    req.on('data', (chunk) => chunks.push(chunk));
    req.on('end', () => {
      spans += countSpans(Buffer.concat(chunks));
      res.writeHead(200, { 'content-type': 'application/json' }).end('{}');
    });
  });
  server.listen(0, '127.0.0.1');
  await once(server, 'listening');
  return {
    url: `http://127.0.0.1:${server.address().port}/v1/traces`,
    spans: () => spans,
    close: () => new Promise((done) => server.close(done)),
  };
}
