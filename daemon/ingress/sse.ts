/**
 * Server-sent events on a raw Node response, as OpenAI streams them: `data: {json}\n\n` per event
 * and `data: [DONE]\n\n` at the end. Writes respect backpressure; a closed client ends writing.
 */
import type { ServerResponse } from 'node:http'
import { once } from 'node:events'
import { stepMark } from '../step-trace.ts'

export interface SseWriter {
  /** Writes one event; resolves once the socket can take more. False when the client is gone. */
  send (data: unknown, signal: AbortSignal): Promise<boolean>
  /** Writes `data: [DONE]` and ends the response. */
  done (): void
  readonly closed: boolean
}

export function openSse (res: ServerResponse, headers: Record<string, string>): SseWriter {
  res.writeHead(200, {
    ...headers,
    'content-type': 'text/event-stream; charset=utf-8',
    'cache-control': 'no-cache',
    connection: 'keep-alive',
    // Proxies such as nginx buffer responses unless told not to.
    'x-accel-buffering': 'no',
  })
  const closed = (): boolean => res.destroyed || res.writableEnded
  // The headers leave with the first event, in one write: a stream opens once its prefill is done,
  // so that event follows within the same turn of the event loop, and a write of their own cost
  // a syscall and a wake-up of the client before the first token (~0.3 ms of a 128-token TTFT;
  // docs/engine-notes.md, wave 17). A first event that takes longer (its text held back) does
  // not hold them: they go at the next turn.
  let wrote = false // res.headersSent cannot tell: it is true from writeHead on
  setImmediate(() => { if (!wrote && !closed()) res.flushHeaders() })
  return {
    get closed () { return closed() },
    async send (data, signal) {
      if (closed()) return false
      wrote = true
      const flushed = res.write(`data: ${JSON.stringify(data)}\n\n`)
      // Node's http corks the socket at a response's write and uncorks it on the next tick (the
      // chunk's framing and data in one syscall). The next tick comes only when the microtasks run
      // out, and a generation runs in microtasks: after a stream's token, its receipt was built
      // and signed before anything yielded, so the client got the token 1.3–3.5 ms after this
      // write (60m int4, docs/engine-notes.md, wave 24). Uncorked here, the event leaves now.
      if (res.writableCorked > 0) res.uncork()
      stepMark('i.write')
      if (!flushed) {
        try {
          await once(res, 'drain', { signal })
        } catch {
          return false
        }
      }
      return !closed()
    },
    done () {
      wrote = true
      if (!closed()) res.end('data: [DONE]\n\n')
    },
  }
}
