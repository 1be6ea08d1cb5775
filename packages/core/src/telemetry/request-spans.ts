/**
 * One server span per data-plane request, opened by the route's first handler: its parent is the
 * caller's `traceparent` (so one rollout's calls from environment to agent to policy and resources
 * are one trace), named `<METHOD> <route template>` as the HTTP conventions name server spans.
 */
import { type Attributes, context, SpanStatusCode, trace } from '@opentelemetry/api';
import {
  ATTR_HTTP_REQUEST_METHOD,
  ATTR_HTTP_RESPONSE_STATUS_CODE,
  ATTR_HTTP_ROUTE,
} from '@opentelemetry/semantic-conventions';
import type { RequestHandler } from 'express';

import { captureKey, requestEpisode } from '../identity.js';
import { startServerSpan } from './server-span.js';
import { callerContext, spanRecorder } from './tracing.js';

/** The episode a data-plane request is part of (its `/ng-rollout/<key>` prefix). */
export const ATTR_CAPTURE_KEY = 'nemo.gym.capture_key';

/**
 * The route's first handler: opens the request's span (when tracing is on) and ends it when the
 * response closes, with the status; a 5xx marks it failed. Never answers.
 */
export function traceRequest(route: string): RequestHandler {
  return (req, res, next) => {
    const recorder = spanRecorder();
    if (recorder === undefined) {
      next();
      return;
    }
    const episode = requestEpisode(req);
    const parent = callerContext(req.headers);
    const attributes: Attributes = {
      [ATTR_HTTP_REQUEST_METHOD]: req.method,
      [ATTR_HTTP_ROUTE]: route,
    };
    if (episode !== undefined) attributes[ATTR_CAPTURE_KEY] = captureKey(episode);
    const span = startServerSpan(recorder, `${req.method} ${route}`, attributes, parent);
    res.once('close', () => {
      span.setAttribute(ATTR_HTTP_RESPONSE_STATUS_CODE, res.statusCode);
      if (res.statusCode >= 500) span.setStatus({ code: SpanStatusCode.ERROR });
      span.end();
    });
    // The handlers after this one run in the span's context (body-parser keeps it across the
    // body's socket events).
    context.with(trace.setSpan(parent, span), next);
  };
}
