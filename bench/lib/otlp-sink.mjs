/* global Buffer */
// A local OTLP/HTTP sink for benchmarks with tracing on: answers every export 200 and counts the
// spans it was sent, so a run can tell its servers really traced (and what tracing costs them).
import { once } from 'node:events';
import { createServer } from 'node:http';

/** Listens on a free loopback port; `url` is the traces endpoint to hand the servers. */
export async function otlpSink() {
  let spans = 0;
  const server = createServer((req, res) => {
    const chunks = [];
    req.on('data', (chunk) => chunks.push(chunk));
    req.on('end', () => {
      const body = JSON.parse(Buffer.concat(chunks).toString('utf8'));
      for (const resource of body.resourceSpans ?? [])
        for (const scope of resource.scopeSpans ?? []) spans += scope.spans?.length ?? 0;
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
