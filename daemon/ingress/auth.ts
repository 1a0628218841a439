/**
 * Client keys at the ingress: with an `auth` component every /v1/* request and every dashboard
 * data route (/dashboard/*: the state, the event stream, receipt checks: they show the mesh, its
 * load and this node's receipts) must carry `Authorization: Bearer KEY`, else 401 in OpenAI's
 * error shape (before any body is read). The key's identity rides on the request for the receipt.
 * The ingress only shapes HTTP: whether a key is valid is the `ClientAuth` component's decision
 * (the daemon's, over certs/).
 *
 * Open without a key: /healthz and /metrics (health checks and Prometheus scrapers carry no client
 * key, and neither route shows requests or receipts), and the dashboard page `GET /` itself — static
 * HTML with no data in it, which asks the operator for a key and sends it on its own fetches.
 */
import type { FastifyInstance, FastifyRequest } from 'fastify'
import { ShoalError } from '../errors.ts'
import type { ClientIdentity } from '../service.ts'

export type ClientCheck =
  | { ok: true, client: ClientIdentity }
  | { ok: false, detail: string }

export interface ClientAuth {
  /** Decides on a bearer token (never logged, never echoed). */
  check (token: string): ClientCheck
}

export class AuthError extends ShoalError {
  override name = 'AuthError'
  constructor (message: string) {
    super('SHOAL_ERR_INVALID_API_KEY', message)
  }
}

const clients = new WeakMap<FastifyRequest, ClientIdentity>()

/** The client key that authenticated this request, when keys are required. */
export function clientOf (request: FastifyRequest): ClientIdentity | undefined {
  return clients.get(request)
}

/** The token of an `Authorization: Bearer TOKEN` header, or undefined. */
export function bearerToken (header: string | string[] | undefined): string | undefined {
  if (typeof header !== 'string') return undefined
  const m = /^Bearer[ \t]+(\S+)[ \t]*$/i.exec(header)
  return m === null ? undefined : m[1]
}

const under = (prefix: string, path: string): boolean => path === prefix || path.startsWith(`${prefix}/`)
const guarded = (path: string): boolean => under('/v1', path) || under('/dashboard', path)

/**
 * Whether a request needs a key: judged by the route the router matched, not by the raw URL — the
 * router decodes percent-encoding, so `/%761/models` reaches `/v1/models` while its raw URL does not
 * start with `/v1/` (it passed without a key). A request that matched no route is judged by its
 * decoded path, so an unknown /v1 or /dashboard path stays a 401 rather than a 404 that tells a
 * keyless client what exists.
 */
export function needsKey (request: FastifyRequest): boolean {
  const route = request.routeOptions.url
  if (route !== undefined) return guarded(route)
  const raw = request.url.split('?')[0] ?? ''
  let path = raw
  try { path = decodeURIComponent(raw) } catch { /* not valid percent-encoding: judged as sent */ }
  return guarded(raw) || guarded(path)
}

/** Adds the key check for /v1/* and /dashboard/*; call after the hooks that count and refuse while stopping. */
export function registerAuth (app: FastifyInstance, auth: ClientAuth): void {
  app.addHook('onRequest', async (request, reply) => {
    if (!needsKey(request)) return
    const token = bearerToken(request.headers.authorization)
    reply.header('www-authenticate', 'Bearer realm="shoal"')
    if (token === undefined) {
      throw new AuthError('You did not provide an API key. This node requires one: send Authorization: Bearer KEY with a key from `shoal ca key`.')
    }
    const checked = auth.check(token)
    if (!checked.ok) throw new AuthError(`Incorrect API key provided: ${checked.detail}`)
    reply.removeHeader('www-authenticate')
    clients.set(request, checked.client)
  })
}
