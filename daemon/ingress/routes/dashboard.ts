/**
 * The dashboard: `GET /` is one small self-contained HTML page (inline CSS and JS, no build step,
 * no external requests) that shows what `GET /dashboard/state` returns and keeps it live over
 * `GET /dashboard/events` (server-sent events). `GET /dashboard/receipts/:id/verify` checks one
 * receipt's signatures and hash links on the server, for the page's verify buttons.
 *
 * The event stream is bounded: at most `maxClients` at once (429 beyond), each connection lives at
 * most `maxStreamMs` (the page reconnects after `retry`), a client that does not read is skipped
 * (every event is the whole state, so a skipped one loses nothing), and the ingress's close ends
 * every stream with a `bye` event before the server closes.
 *
 * With client keys required, every route here but the page needs the key (auth.ts `needsKey`).
 */
import { once } from 'node:events'
import { readFileSync } from 'node:fs'
import type { ServerResponse } from 'node:http'
import { setTimeout as delay } from 'node:timers/promises'
import type { FastifyInstance } from 'fastify'
import { ShoalError } from '../../errors.ts'
import { RequestError } from '../errors.ts'
import type { DashboardSource } from '../types.ts'

export interface DashboardOptions {
  /** Event streams open at once before 429. Default 32. */
  maxClients?: number
  /** A stream is ended (and reconnected by the browser) after this long. Default 10 minutes. */
  maxStreamMs?: number
  /** The state is pushed at least this often while streams are open. Default 1 s. */
  intervalMs?: number
  /** Changes (a peer joins or leaves) are pushed at most this often. Default 250 ms. */
  minIntervalMs?: number
}

const DEFAULTS: Required<DashboardOptions> = { maxClients: 32, maxStreamMs: 10 * 60_000, intervalMs: 1_000, minIntervalMs: 250 }
/** Bytes a client may leave unread before its updates are skipped. */
const MAX_UNREAD_BYTES = 256 * 1024
/** What the page waits before reconnecting a dropped stream (the `retry:` field). */
const RETRY_MS = 2_000

let page: string | undefined
const pageHtml = (): string => (page ??= readFileSync(new URL('../dashboard.html', import.meta.url), 'utf8'))

const HTML_HEADERS = {
  'content-type': 'text/html; charset=utf-8',
  'cache-control': 'no-store',
  // The page loads nothing from anywhere: its script and style are inline, its data from this origin.
  'content-security-policy': "default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; connect-src 'self'; img-src data:; base-uri 'none'; form-action 'none'",
  'x-content-type-options': 'nosniff',
  'referrer-policy': 'no-referrer',
}

export interface DashboardRoutes {
  /** Ends every event stream with a `bye` event and waits (bounded) until they are flushed. */
  close (): Promise<void>
}

/** How long close() waits for the streams' last bytes to leave. */
const CLOSE_FLUSH_MS = 1_000

export function registerDashboardRoutes (app: FastifyInstance, source: DashboardSource, options: DashboardOptions = {}): DashboardRoutes {
  const cfg = { ...DEFAULTS, ...Object.fromEntries(Object.entries(options).filter(([, v]) => v !== undefined)) }
  const clients = new Set<{ res: ServerResponse, end: () => void }>()
  let timer: ReturnType<typeof setInterval> | undefined
  let pending: ReturnType<typeof setTimeout> | undefined
  let lastPush = 0
  let unsubscribe: (() => void) | undefined
  let closing = false

  const write = (res: ServerResponse, event: string, data: string): void => {
    if (res.destroyed || res.writableEnded || res.writableLength > MAX_UNREAD_BYTES) return
    res.write(`event: ${event}\ndata: ${data}\n\n`)
  }

  /** One state for every open stream. */
  const push = async (): Promise<void> => {
    lastPush = Date.now()
    if (clients.size === 0) return
    let data: string
    try {
      data = JSON.stringify(await source.state())
    } catch (err) {
      app.log.debug({ err }, 'dashboard state failed')
      return
    }
    for (const c of clients) write(c.res, 'state', data)
  }

  /** A change pushes soon, but never more often than minIntervalMs. */
  const changed = (): void => {
    if (clients.size === 0 || pending !== undefined) return
    const wait = Math.max(0, lastPush + cfg.minIntervalMs - Date.now())
    pending = setTimeout(() => { pending = undefined; void push() }, wait)
    pending.unref()
  }

  const startFeed = (): void => {
    if (timer !== undefined) return
    timer = setInterval(() => { void push() }, cfg.intervalMs)
    timer.unref()
    unsubscribe = source.onChange?.(changed)
  }
  const stopFeed = (): void => {
    if (timer !== undefined) clearInterval(timer)
    if (pending !== undefined) clearTimeout(pending)
    timer = undefined
    pending = undefined
    unsubscribe?.()
    unsubscribe = undefined
  }

  app.get('/', async (_request, reply) => await reply.headers(HTML_HEADERS).send(pageHtml()))

  app.get('/dashboard/state', async (_request, reply) => await reply.header('cache-control', 'no-store').send(await source.state()))

  app.get<{ Params: { id: string } }>('/dashboard/receipts/:id/verify', async (request) => {
    const result = await source.verify(request.params.id)
    if (result === undefined) throw new RequestError('SHOAL_ERR_NOT_FOUND', `No receipt with id '${request.params.id}'`, 'id')
    return result
  })

  app.get('/dashboard/events', async (_request, reply) => {
    if (closing) throw new ShoalError('SHOAL_ERR_SHUTTING_DOWN', 'Server is shutting down')
    if (clients.size >= cfg.maxClients) throw new ShoalError('SHOAL_ERR_OVERLOADED', `Too many dashboard streams open (${cfg.maxClients}); retry later`)
    reply.hijack()
    const res = reply.raw
    res.writeHead(200, {
      'content-type': 'text/event-stream; charset=utf-8',
      'cache-control': 'no-cache',
      connection: 'keep-alive',
      'x-accel-buffering': 'no',
    })
    res.write(`retry: ${RETRY_MS}\n\n`)
    const lifetime = setTimeout(() => { client.end() }, cfg.maxStreamMs)
    lifetime.unref()
    const client = {
      res,
      end: () => {
        if (!res.writableEnded && !res.destroyed) res.end('event: bye\ndata: {}\n\n')
      },
    }
    clients.add(client)
    res.once('close', () => {
      clearTimeout(lifetime)
      clients.delete(client)
      if (clients.size === 0) stopFeed()
    })
    startFeed()
    // The new client gets the state at once, not at the next tick.
    try {
      write(res, 'state', JSON.stringify(await source.state()))
    } catch (err) {
      app.log.debug({ err }, 'dashboard state failed')
    }
  })

  const close = async (): Promise<void> => {
    closing = true
    stopFeed()
    const ended = [...clients].map(async c => {
      if (c.res.destroyed) return
      c.end()
      await Promise.race([once(c.res, 'close'), delay(CLOSE_FLUSH_MS, undefined, { ref: false })])
    })
    await Promise.all(ended)
  }
  // Also when the app is closed without the ingress's stop (tests closing it directly).
  app.addHook('preClose', close)
  return { close }
}
