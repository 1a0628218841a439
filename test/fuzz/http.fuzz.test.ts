/**
 * Fuzz of the HTTP ingress through the real fastify app (`inject`): every route, any method, any
 * path spelling (percent-encoding, case, slashes, queries), any body (arbitrary JSON values,
 * arbitrary text, any content type, streaming or not) and, with keys required, any Authorization
 * header. The answer is always a status in {200, 400, 401, 404, 413, 415, 422, 429} with OpenAI's
 * error shape for the errors — never a 500 — and with keys required nothing under /v1 or
 * /dashboard is reached without a valid key, however the path is spelled.
 * (Structured chat/completion bodies with arbitrary field values: test/ingress/malformed-http.test.ts.)
 */
import fc from 'fast-check'
import { afterAll, beforeAll, describe, expect, it } from 'vitest'
import { createClientKey, encodeClientKey } from '../../certs/index.ts'
import { createIngress, type Ingress } from '../../daemon/ingress/index.ts'
import { createClientAuth } from '../../daemon/node/client-auth.ts'
import { expectOpenAIError } from '../ingress/harness.ts'
import { createSimulatedService } from '../support/simulated-service.ts'
import { DAY, makeCa } from '../certs/fixtures.ts'
import { anyJson, mutation, reportRuns, runs } from './fuzz.ts'

reportRuns(import.meta.filename)

const ALLOWED = new Set([200, 400, 401, 404, 413, 415, 422, 429])
const METHODS = ['GET', 'POST', 'PUT', 'DELETE', 'PATCH', 'OPTIONS', 'HEAD'] as const
const ROUTES = ['/v1/models', '/v1/receipts/known', '/v1/receipts/other', '/v1/mesh', '/v1/chat/completions', '/v1/completions', '/healthz', '/metrics', '/', '/dashboard/state', '/dashboard/receipts/known/verify']
// Open with keys required: health checks and scrapers carry no key; the page is static HTML (its
// data routes under /dashboard need the key).
const OPEN = new Set(['/healthz', '/metrics', '/'])

/** What the components were asked, so a test can tell which route a request reached. */
const reached: string[] = []
const NOW = Date.now()
const ca = makeCa()
const validKey = encodeClientKey(createClientKey(ca.secretKey, ca.certificate, { name: 'fuzz', notBefore: new Date(NOW - DAY), notAfter: new Date(NOW + DAY) }))

function make (keys: boolean): Ingress {
  const service = createSimulatedService({ models: [{ id: 'sim' }] })
  return createIngress({ logger: false, bodyLimitBytes: 64 * 1024 }, {
    service: {
      models: () => { reached.push('models'); return service.models() },
      generate: (request, signal) => { reached.push('generate'); return service.generate(request, signal) },
    },
    receipts: { get: async (id) => { reached.push('receipts'); return id === 'known' ? { body: { id }, signature: 's' } : undefined } },
    mesh: { snapshot: () => { reached.push('mesh'); return { peers: [] } } },
    // No onChange: /dashboard/events (SSE, open until the client leaves) is left out of the paths below.
    dashboard: { state: async () => { reached.push('dashboard'); return { peers: [] } }, verify: async (id) => { reached.push('dashboard'); return id === 'known' ? { ok: true } : undefined } },
    ...(keys ? { auth: createClientAuth({ caCertificate: ca.certificate, revocations: () => undefined }) } : {}),
  })
}

// ---- paths: the real routes spelled every way a client (or an attacker) can ----

const pathChars = fc.constantFrom(...'abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-._~!$&\'()*+,;=:@/%?[]')
const hex2 = (c: string): string => c.charCodeAt(0).toString(16).padStart(2, '0')
type Edit = (p: string) => string
const edit: fc.Arbitrary<Edit> = fc.oneof(
  // Percent-encode one character (either hex case), or all of them.
  { weight: 4, arbitrary: fc.tuple(fc.nat(), fc.boolean()).map(([n, upper]): Edit => p => { const at = 1 + (n % Math.max(1, p.length - 1)); const h = hex2(p[at] ?? 'a'); return `${p.slice(0, at)}%${upper ? h.toUpperCase() : h}${p.slice(at + 1)}` }) },
  fc.constant<Edit>(p => p.split('').map((c, i) => i === 0 || c === '/' ? c : `%${hex2(c)}`).join('')),
  fc.nat().map((n): Edit => p => { const at = n % p.length; return p.slice(0, at) + p.charAt(at).toUpperCase() + p.slice(at + 1) }),
  fc.tuple(fc.nat(), fc.string({ unit: pathChars, maxLength: 4 })).map(([n, s]): Edit => p => { const at = n % (p.length + 1); return p.slice(0, at) + s + p.slice(at) }),
  fc.constantFrom<Edit>(p => `${p}/`, p => `/${p}`, p => p.replace('/', '//'), p => `${p}?`, p => `${p}#x`, p => p.replace(/\/([^/]*)$/, '/./$1'), p => p.replace(/\/([^/]*)$/, '/x/../$1')),
  fc.string({ unit: pathChars, maxLength: 20 }).map((q): Edit => p => `${p}?${q}`),
)
const path = fc.oneof(
  fc.tuple(fc.constantFrom(...ROUTES), fc.array(edit, { maxLength: 3 })).map(([p, edits]) => edits.reduce((acc, e) => e(acc), p)),
  fc.string({ unit: pathChars, maxLength: 40 }).map(s => `/${s}`),
).filter(p => !/events/i.test(safeDecode(p)))

function safeDecode (p: string): string {
  try { return decodeURIComponent(p) } catch { return p }
}

const body = fc.oneof(
  anyJson.map(v => JSON.stringify(v) ?? ''),
  fc.string({ unit: 'binary', maxLength: 100 }),
  fc.record({ model: fc.constantFrom('sim', 'nope'), prompt: fc.string({ maxLength: 20 }), messages: fc.constant([{ role: 'user', content: 'hi' }]), max_tokens: fc.integer({ min: 0, max: 4 }), stream: fc.boolean(), extra: anyJson }, { requiredKeys: [] }).map(v => JSON.stringify(v)),
)
const contentType = fc.oneof(fc.constantFrom('application/json', 'application/json; charset=utf-8', 'text/plain', 'application/x-www-form-urlencoded', 'multipart/form-data; boundary=x', 'application/octet-stream', ''), fc.string({ maxLength: 30 }))

async function send (ingress: Ingress, method: typeof METHODS[number], url: string, payload?: string, headers: Record<string, string> = {}): Promise<{ status: number, json: () => unknown, body: string, headers: Record<string, unknown> }> {
  const res = await ingress.app.inject({ method, url, headers, ...(payload === undefined || method === 'GET' || method === 'HEAD' ? {} : { payload }) })
  return { status: res.statusCode, json: () => res.json(), body: res.body, headers: res.headers }
}

function expectAllowed (res: { status: number, json: () => unknown, body: string }, method: string, what: string): void {
  expect(ALLOWED.has(res.status), `${res.status} for ${what}: ${res.body.slice(0, 300)}`).toBe(true)
  if (res.status !== 200 && method !== 'HEAD') expectOpenAIError(res.json())
}

/** A header value light-my-request (and Node's HTTP parser) would send: no control characters. */
const headerValue = (s: string): boolean => /^[\t\x20-\x7e\x80-\xff]*$/.test(s)

describe('HTTP ingress, keys not required', () => {
  let ingress: Ingress
  beforeAll(async () => { ingress = make(false); await ingress.app.ready() })
  afterAll(async () => { await ingress.stop() })

  it('any method, path and body: an allowed status, errors in OpenAI\'s shape', async () => {
    await fc.assert(fc.asyncProperty(fc.constantFrom(...METHODS), path, fc.option(body, { nil: undefined }), contentType, async (method, url, payload, type) => {
      fc.pre(headerValue(type))
      expectAllowed(await send(ingress, method, url, payload, type === '' ? {} : { 'content-type': type }), method, `${method} ${url} (${type}) ${payload?.slice(0, 100)}`)
    }), runs('http: any method, path, body, content type', 300))
  })

  it('each completion endpoint, any JSON value as the body, streaming or not', async () => {
    const streaming = fc.record({ model: fc.constant('sim'), prompt: fc.string({ maxLength: 10 }), messages: fc.constant([{ role: 'user', content: 'hi' }]), stream: fc.constant(true), max_tokens: fc.oneof(fc.integer({ min: 0, max: 3 }), anyJson), stream_options: anyJson, stop: anyJson, n: anyJson }, { requiredKeys: ['model', 'stream'] })
    await fc.assert(fc.asyncProperty(fc.constantFrom('/v1/chat/completions', '/v1/completions'), fc.oneof(anyJson, streaming), async (url, value) => {
      const res = await send(ingress, 'POST', url, JSON.stringify(value) ?? 'null', { 'content-type': 'application/json' })
      expectAllowed(res, 'POST', `${url} ${JSON.stringify(value)?.slice(0, 200)}`)
      // A stream that started is SSE to its end: [DONE], or an error event in OpenAI's shape.
      if (res.status === 200 && String(res.headers['content-type']).startsWith('text/event-stream')) {
        const events = res.body.split('\n\n').filter(e => e !== '')
        const last = events.at(-1)
        if (last !== 'data: [DONE]') expectOpenAIError(JSON.parse(last!.slice('data: '.length)))
      }
    }), runs('http: completion endpoints, any JSON value, streaming', 300))
  })

  it('receipt ids of any spelling are a receipt or a 404, never a 500', async () => {
    await fc.assert(fc.asyncProperty(fc.string({ unit: pathChars, minLength: 1, maxLength: 60 }), async (id) => {
      for (const url of [`/v1/receipts/${id}`, `/dashboard/receipts/${id}/verify`]) expectAllowed(await send(ingress, 'GET', url), 'GET', url)
    }), runs('http: receipt ids', 200))
  })
})

describe('HTTP ingress, keys required', () => {
  let ingress: Ingress
  beforeAll(async () => { ingress = make(true); await ingress.app.ready() })
  afterAll(async () => { await ingress.stop() })

  it('without a valid key nothing under /v1 or /dashboard is reached, however the path is spelled', async () => {
    const badKey = fc.oneof(
      fc.constant(undefined),
      fc.string({ maxLength: 80 }),
      fc.string({ maxLength: 80 }).map(s => `Bearer ${s}`),
      mutation(new TextEncoder().encode(validKey)).map(b => `Bearer ${Buffer.from(b).toString('latin1')}`),
      fc.constantFrom(`bearer ${validKey}x`, `Basic ${validKey}`, `Bearer  ${validKey} extra`, validKey),
    )
    await fc.assert(fc.asyncProperty(fc.constantFrom(...METHODS), path, badKey, fc.option(body, { nil: undefined }), async (method, url, auth, payload) => {
      fc.pre(auth === undefined || headerValue(auth))
      reached.length = 0
      const res = await send(ingress, method, url, payload, { 'content-type': 'application/json', ...(auth === undefined ? {} : { authorization: auth }) })
      expectAllowed(res, method, `${method} ${url} with ${auth?.slice(0, 40)}`)
      // Only the open routes (health, metrics, the dashboard page) may answer 200 or touch a component.
      // (Dot segments resolved as the client resolves them before sending: /./metrics is /metrics.)
      const open = OPEN.has(safeDecode(URL.parse(`http://x${url}`)?.pathname ?? url))
      if (!open) {
        expect(reached, `${method} ${url} reached ${reached.join(', ')} without a key`).toEqual([])
        expect(res.status, `${method} ${url}`).not.toBe(200)
      }
    }), runs('http: keys required, paths to the routes', 400))
  })

  it('the valid key is served on every route spelling that reaches one', async () => {
    const res = await send(ingress, 'POST', '/%761/completions', JSON.stringify({ model: 'sim', prompt: 'hi', max_tokens: 2 }), { 'content-type': 'application/json', authorization: `Bearer ${validKey}` })
    expect(res.status).toBe(200)
    expect((await send(ingress, 'GET', '/v1/models', undefined, { authorization: `Bearer ${validKey}` })).status).toBe(200)
  })
})
