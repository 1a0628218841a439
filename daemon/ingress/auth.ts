/**
 * Client keys at the ingress: with an `auth` component every /v1/* request must carry
 * `Authorization: Bearer KEY`, else 401 in OpenAI's error shape (before any body is read). The
 * key's identity rides on the request for the receipt. The ingress only shapes HTTP: whether a
 * key is valid is the `ClientAuth` component's decision (the daemon's, over certs/).
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

const underV1 = (path: string): boolean => path === '/v1' || path.startsWith('/v1/')

/**
 * Whether a request needs a key: judged by the route the router matched, not by the raw URL — the
 * router decodes percent-encoding, so `/%761/models` reaches `/v1/models` while its raw URL does not
 * start with `/v1/` (it passed without a key). A request that matched no route is judged by its
 * decoded path, so an unknown /v1 path stays a 401 rather than a 404 that tells a keyless client
 * what exists.
 */
export function needsKey (request: FastifyRequest): boolean {
  const route = request.routeOptions.url
  if (route !== undefined) return underV1(route)
  const raw = request.url.split('?')[0] ?? ''
  let path = raw
  try { path = decodeURIComponent(raw) } catch { /* not valid percent-encoding: judged as sent */ }
  return underV1(raw) || underV1(path)
}

/** Adds the key check for /v1/*; call after the hooks that count and refuse while stopping. */
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
