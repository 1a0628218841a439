/**
 * The dashboard behind `--require-keys` (fastify inject, no socket): its data routes — the state,
 * the event stream, receipt checks, and unknown paths under /dashboard — answer 401 in OpenAI's
 * shape without a valid key, however the path is spelled, and serve with one; the page itself
 * (static HTML, no data), /healthz and /metrics stay open. Without keys required every route is
 * open as before.
 */
import { afterAll, beforeAll, describe, expect, it } from 'vitest'
import { createClientKey, encodeClientKey } from '../../certs/index.ts'
import { createIngress } from '../../daemon/ingress/index.ts'
import type { DashboardSource, Ingress } from '../../daemon/ingress/index.ts'
import { createClientAuth } from '../../daemon/node/client-auth.ts'
import { createSimulatedService } from '../support/simulated-service.ts'
import { DAY, makeCa } from '../certs/fixtures.ts'
import { expectOpenAIError } from './harness.ts'

const NOW = Date.now()
const ca = makeCa()
const validKey = encodeClientKey(createClientKey(ca.secretKey, ca.certificate, { name: 'ops', notBefore: new Date(NOW - DAY), notAfter: new Date(NOW + DAY) }))
const foreignCa = makeCa('other-ca')
const foreignKey = encodeClientKey(createClientKey(foreignCa.secretKey, foreignCa.certificate, { name: 'eve', notBefore: new Date(NOW - DAY), notAfter: new Date(NOW + DAY) }))

/** What the dashboard source was asked: a refused request must not reach it. */
const asked: string[] = []
const source: DashboardSource = {
  async state () { asked.push('state'); return { format: 'test' } },
  async verify (id) { asked.push('verify'); return id === 'r-1' ? { id, ok: true, checks: [] } : undefined },
}

function make (keys: boolean): Ingress {
  return createIngress({ logger: false }, {
    service: createSimulatedService({ models: [{ id: 'sim' }] }),
    dashboard: source,
    ...(keys ? { auth: createClientAuth({ caCertificate: ca.certificate, revocations: () => undefined }) } : {}),
  })
}

const DATA_ROUTES = ['/dashboard/state', '/dashboard/events', '/dashboard/receipts/r-1/verify']

describe('dashboard with keys required', () => {
  let ingress: Ingress
  beforeAll(async () => { ingress = make(true); await ingress.app.ready() })
  afterAll(async () => { await ingress.stop() })

  it('refuses the data routes without a valid key (401, OpenAI shape), before the source is asked', async () => {
    const spellings = [...DATA_ROUTES, '/%64ashboard/state', '/dashboard/%73tate', '/dashboard/nope', '/dashboard']
    for (const authorization of [undefined, 'Bearer not-a-key', `Bearer ${foreignKey}`, `Basic ${validKey}`]) {
      for (const url of spellings) {
        asked.length = 0
        const res = await ingress.app.inject({ method: 'GET', url, headers: authorization === undefined ? {} : { authorization } })
        expect(res.statusCode, `${url} with ${authorization?.slice(0, 20)}`).toBe(401)
        expect(res.headers['www-authenticate']).toMatch(/^Bearer/)
        expect(expectOpenAIError(res.json()).code).toBe('SHOAL_ERR_INVALID_API_KEY')
        expect(asked, url).toEqual([])
      }
    }
  })

  it('serves the state and receipt checks with a valid key', async () => {
    const headers = { authorization: `Bearer ${validKey}` }
    const state = await ingress.app.inject({ method: 'GET', url: '/dashboard/state', headers })
    expect(state.statusCode).toBe(200)
    expect(state.json()).toEqual({ format: 'test' })
    const verified = await ingress.app.inject({ method: 'GET', url: '/dashboard/receipts/r-1/verify', headers })
    expect(verified.statusCode).toBe(200)
    expect(verified.json()).toMatchObject({ id: 'r-1', ok: true })
    // A known route with the key but no such receipt: the route's own 404.
    const missing = await ingress.app.inject({ method: 'GET', url: '/dashboard/receipts/nope/verify', headers })
    expect(missing.statusCode).toBe(404)
  })

  it('serves the event stream with a valid key', async () => {
    const { url } = await ingress.start()
    const ac = new AbortController()
    const res = await fetch(`${url}/dashboard/events`, { headers: { authorization: `Bearer ${validKey}` }, signal: ac.signal })
    expect(res.status).toBe(200)
    expect(res.headers.get('content-type')).toMatch(/^text\/event-stream/)
    ac.abort()
  })

  it('keeps the page, /healthz and /metrics open: the page carries no data and asks for a key', async () => {
    for (const url of ['/', '/healthz', '/metrics']) {
      expect((await ingress.app.inject({ method: 'GET', url })).statusCode, url).toBe(200)
    }
    const page = (await ingress.app.inject({ method: 'GET', url: '/' })).body
    expect(page).toContain('id="key-form"')
    expect(page).toContain('sessionStorage')
    expect(page).toContain('authorization: `Bearer ${key}`')
    // The stream is read with fetch() so the header can be sent; EventSource cannot send one.
    expect(page).not.toContain('new EventSource')
  })
})

describe('dashboard without keys required', () => {
  let ingress: Ingress
  beforeAll(async () => { ingress = make(false); await ingress.app.ready() })
  afterAll(async () => { await ingress.stop() })

  it('serves every dashboard route without a key', async () => {
    for (const url of ['/', '/dashboard/state', '/dashboard/receipts/r-1/verify']) {
      expect((await ingress.app.inject({ method: 'GET', url })).statusCode, url).toBe(200)
    }
    expect((await ingress.app.inject({ method: 'GET', url: '/dashboard/nope' })).statusCode).toBe(404)
  })
})
