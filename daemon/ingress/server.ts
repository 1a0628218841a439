/**
 * Builds the fastify app: routes, the error reply, admission (concurrency bound, 503 while
 * stopping), request metrics, large JSON bodies parsed off the event loop, and the start/stop
 * lifecycle with a bounded drain.
 */
import { randomUUID } from 'node:crypto'
import type { AddressInfo } from 'node:net'
import Fastify, { LogController, type FastifyBaseLogger, type FastifyInstance, type FastifyRequest, type FastifyServerOptions } from 'fastify'
import type { Logger } from 'pino'
import { Registry } from 'prom-client'
import { ShoalError } from '../errors.ts'
import { clientErrorResponse, fromFastifyError, sendError } from './errors.ts'
import type { GenerationContext } from './generation.ts'
import { registerJsonParser } from './json-body.ts'
import { createIngressMetrics } from './metrics.ts'
import { registerChatRoute } from './routes/chat.ts'
import { registerCompletionsRoute } from './routes/completions.ts'
import { registerDashboardRoutes } from './routes/dashboard.ts'
import { registerInfoRoutes } from './routes/info.ts'
import { registerAuth } from './auth.ts'
import type { Ingress, IngressComponents, IngressInit, IngressLimits } from './types.ts'
import { stepMark } from '../step-trace.ts'

export const DEFAULT_INGRESS_LIMITS: Readonly<IngressLimits> = Object.freeze({
  bodyLimitBytes: 8 * 1024 * 1024,
  maxConcurrentRequests: 64,
  drainTimeoutMs: 30_000,
  receiveTimeoutMs: 120_000,
})

const DEFAULTS = {
  host: '127.0.0.1',
  port: 0,
  requestTimeoutMs: 10 * 60_000,
  ...DEFAULT_INGRESS_LIMITS,
}

/** After a drain times out and running requests are aborted, how long they get to unwind. */
const ABORT_GRACE_MS = 5_000

declare module 'fastify' {
  interface FastifyContextConfig {
    /** Counts toward maxConcurrentRequests. */
    completion?: boolean
  }
}

function loggerOptions (logger: Logger | false | undefined): FastifyServerOptions {
  if (logger === undefined) return { logger: { level: 'info' } }
  if (logger === false) return { logger: false }
  return { loggerInstance: logger as FastifyBaseLogger }
}

export function createIngress (init: IngressInit, components: IngressComponents): Ingress {
  const cfg = { ...DEFAULTS, ...Object.fromEntries(Object.entries(init).filter(([, v]) => v !== undefined)) }
  const registry = components.metrics ?? new Registry()
  const metrics = createIngressMetrics(registry)

  const app = Fastify({
    ...loggerOptions(init.logger),
    // HTTPS with the operator's certificate: same routes, same app; only the server differs.
    ...(init.tls === undefined ? {} : { https: { cert: init.tls.cert, key: init.tls.key } }),
    bodyLimit: cfg.bodyLimitBytes,
    // Time to receive a whole request (not to answer it): fastify's default 0 would let slow
    // senders hold sockets forever.
    requestTimeout: cfg.receiveTimeoutMs,
    genReqId: () => randomUUID(),
    requestIdHeader: false,
    // fastify's two info lines per request drown the daemon's own; one debug line instead (onRequest).
    logController: new LogController({ disableRequestLogging: true }),
    // Our onRequest hook answers 503 in OpenAI's shape while stopping.
    return503OnClosing: false,
    // validateSchema: our two body schemas are constant, and checked against JSON Schema's
    // meta-schema by test/ingress/schemas.test.ts; checking them at every start compiled the
    // meta-schema's validator first, ~40 ms of a node's start.
    ajv: { customOptions: { coerceTypes: false, removeAdditional: false, allErrors: false, validateSchema: false } },
    // Errors the router finds before any route or hook (a bad percent-encoding, a path segment
    // past maxParamLength) and those the HTTP parser finds: OpenAI's shape too.
    frameworkErrors: (err, _request, reply) => { void sendError(reply, fromFastifyError(err)) },
    clientErrorHandler: (err, socket) => {
      if ((err as { code?: unknown }).code === 'ECONNRESET' || socket.destroyed) return
      if (socket.writable) socket.write(clientErrorResponse(err as { code?: unknown }))
      socket.destroy(err)
    },
  }) as unknown as FastifyInstance

  let stopping = false
  let active = 0
  let onIdle: (() => void) | undefined
  const ctx: GenerationContext = {
    service: components.service,
    metrics,
    requestTimeoutMs: cfg.requestTimeoutMs,
    running: new Set(),
  }

  const routeOf = (request: FastifyRequest): string => request.routeOptions.url ?? 'unmatched'

  app.addHook('onRequest', async (request, reply) => {
    stepMark('i.req')
    const route = routeOf(request)
    metrics.inFlight.inc({ route })
    // 'close' fires for every response, also hijacked (SSE) ones and aborted ones.
    reply.raw.once('close', () => {
      metrics.inFlight.dec({ route })
      metrics.requests.inc({ method: request.method, route, status: String(reply.raw.statusCode) })
      request.log.debug({ method: request.method, url: request.url, status: reply.raw.statusCode, ms: Math.round(reply.elapsedTime) }, 'request')
    })
    if (stopping) {
      reply.header('connection', 'close')
      throw new ShoalError('SHOAL_ERR_SHUTTING_DOWN', 'Server is shutting down')
    }
    if (request.routeOptions.config.completion !== true) return
    if (active >= cfg.maxConcurrentRequests) {
      throw new ShoalError('SHOAL_ERR_OVERLOADED', `Too many requests in flight (${cfg.maxConcurrentRequests}); retry later`)
    }
    active++
    reply.raw.once('close', () => {
      active--
      if (active === 0) onIdle?.()
    })
  })

  if (components.auth !== undefined) registerAuth(app, components.auth)

  app.setErrorHandler((err, _request, reply) => sendError(reply, fromFastifyError(err)))
  app.setNotFoundHandler((request, reply) => sendError(reply,
    new ShoalError('SHOAL_ERR_NOT_FOUND', `Unknown route: ${request.method} ${request.url.split('?')[0] ?? ''}`)))

  const jsonParser = registerJsonParser(app)
  registerInfoRoutes(app, { service: components.service, receipts: components.receipts, mesh: components.mesh, registry })
  registerChatRoute(app, ctx)
  registerCompletionsRoute(app, ctx)
  const dashboard = components.dashboard === undefined ? undefined : registerDashboardRoutes(app, components.dashboard)

  const waitIdle = async (ms: number): Promise<boolean> => {
    if (active === 0) return true
    return await new Promise<boolean>(resolve => {
      const timer = setTimeout(() => { onIdle = undefined; resolve(false) }, ms)
      onIdle = () => { clearTimeout(timer); onIdle = undefined; resolve(true) }
    })
  }

  let stopped: Promise<void> | undefined
  return {
    app,
    get inFlight () { return active },
    async start () {
      await app.listen({ host: cfg.host, port: cfg.port })
      const { address, port } = app.server.address() as AddressInfo
      const host = address.includes(':') ? `[${address}]` : address
      return { url: `${init.tls === undefined ? 'http' : 'https'}://${host}:${port}` }
    },
    async stop () {
      stopped ??= (async () => {
        stopping = true
        if (!await waitIdle(cfg.drainTimeoutMs)) {
          for (const ac of ctx.running) ac.abort(new ShoalError('SHOAL_ERR_SHUTTING_DOWN', 'Server is shutting down'))
          await waitIdle(ABORT_GRACE_MS)
        }
        // Completions are drained; connections that carry no request (a client's spare pooled
        // socket, a preconnect) would otherwise hold close() until the client hangs up.
        // Dashboard event streams end with a last event instead of a cut connection.
        await dashboard?.close()
        const closing = app.close()
        app.server.closeAllConnections()
        await closing
        await jsonParser.close()
      })()
      await stopped
    },
  }
}
