/**
 * Every error the HTTP server emits is in OpenAI's shape (issue 13 #5): bad percent-encoding, a
 * path segment past the router's bound (414), headers past Node's bound (431), bytes that are not
 * HTTP — over a real socket — and a fast-check fuzz of the body decoder: whatever arrives, the
 * answer is a success or an OpenAI-shaped client error, never a 500 or a framework's own body.
 */
import { connect } from 'node:net'
import fc from 'fast-check'
import { afterAll, beforeAll, describe, expect, it } from 'vitest'
import { createIngress, OFFLOAD_JSON_ABOVE_BYTES, type Ingress } from '../../daemon/ingress/index.ts'
import { createSimulatedService } from '../support/simulated-service.ts'
import { expectOpenAIError } from './harness.ts'

/** Sends raw bytes, returns everything the server wrote before closing. */
async function raw (url: string, bytes: string): Promise<string> {
  const u = new URL(url)
  return await new Promise((resolve, reject) => {
    const s = connect(Number(u.port), u.hostname, () => { s.write(bytes) })
    let data = ''
    s.on('data', d => { data += d.toString() })
    s.on('error', reject)
    s.on('close', () => { resolve(data) })
  })
}

function parseRaw (text: string): { status: number, body: unknown } {
  const [head, body] = text.split('\r\n\r\n', 2) as [string, string]
  return { status: Number(head.split(' ')[1]), body: JSON.parse(body) }
}

describe('errors outside the routes', () => {
  let ingress: Ingress
  let url: string
  beforeAll(async () => {
    ingress = createIngress({ logger: false }, {
      service: createSimulatedService({ models: [{ id: 'sim' }] }),
      receipts: { get: async () => undefined },
    })
    url = (await ingress.start()).url
  })
  afterAll(async () => { await ingress.stop() })

  it('a path segment that is not valid percent-encoding is a 400', async () => {
    const res = await fetch(`${url}/v1/receipts/%ff`)
    expect(res.status).toBe(400)
    expect(expectOpenAIError(await res.json())).toMatchObject({ code: 'SHOAL_ERR_BAD_REQUEST', type: 'invalid_request_error' })
  })

  it('a 5,000-character URL is a 414 with a body', async () => {
    const res = await fetch(`${url}/v1/receipts/${'a'.repeat(5000)}`)
    expect(res.status).toBe(414)
    expect(expectOpenAIError(await res.json())).toMatchObject({ code: 'SHOAL_ERR_URI_TOO_LONG', type: 'invalid_request_error' })
  })

  it('headers past the limit are a 431, and bytes that are not HTTP a 400, both in the shape', async () => {
    const big = parseRaw(await raw(url, `GET /v1/models HTTP/1.1\r\nHost: x\r\nX-Big: ${'a'.repeat(20_000)}\r\n\r\n`))
    expect(big.status).toBe(431)
    expect(expectOpenAIError(big.body)).toMatchObject({ code: 'SHOAL_ERR_HEADERS_TOO_LARGE' })
    const garbage = parseRaw(await raw(url, 'NOT HTTP AT ALL\r\n\r\n'))
    expect(garbage.status).toBe(400)
    expect(expectOpenAIError(garbage.body)).toMatchObject({ code: 'SHOAL_ERR_BAD_REQUEST' })
    // Still serving.
    expect((await fetch(`${url}/healthz`)).status).toBe(200)
  })
})

describe('large bodies, parsed off the event loop (issue 13 #2)', () => {
  let ingress: Ingress
  beforeAll(async () => {
    ingress = createIngress({ logger: false }, { service: createSimulatedService({ models: [{ id: 'sim' }] }) })
    await ingress.app.ready()
  })
  afterAll(async () => { await ingress.stop() })
  const post = async (payload: string) => await ingress.app.inject({ method: 'POST', url: '/v1/completions', payload, headers: { 'content-type': 'application/json; charset=utf-8' } })
  const pad = 'x'.repeat(OFFLOAD_JSON_ABOVE_BYTES)

  it('a body past the inline bound is parsed as the small ones are, refusals included', async () => {
    const ok = await post(JSON.stringify({ model: 'sim', prompt: 'hi', user: pad, max_tokens: 3 }))
    expect(ok.statusCode).toBe(200)
    expect(ok.json().choices[0].text).toHaveLength(3)
    const broken = await post(JSON.stringify({ model: 'sim', prompt: pad }).slice(0, -2))
    expect(broken.statusCode).toBe(400)
    expect(expectOpenAIError(broken.json())).toMatchObject({ code: 'SHOAL_ERR_BAD_REQUEST', message: 'Request body is not valid JSON' })
    for (const poison of ['{"__proto__":{"x":1}', '{"constructor":{"prototype":{"x":1}}']) {
      const res = await post(`{"model":"sim","prompt":"${pad}","extra":${poison}}}`)
      expect(res.statusCode).toBe(400)
      // Inline, fastify's own parser refuses them the same way.
      expect((await post(`{"model":"sim","prompt":"hi","extra":${poison}}}`)).statusCode).toBe(400)
    }
    // Nesting: deep but parseable is fine (unknown fields are not looked into); past what can be
    // cloned back from the worker, a 400 — never a stack overflow's 500.
    for (const [depth, status] of [[100_000, 200], [1_000_000, 400]] as const) {
      const nested = '['.repeat(depth) + ']'.repeat(depth)
      const res = await post(`{"model":"sim","prompt":"hi","max_tokens":2,"extra":${nested}}`)
      expect(res.statusCode).toBe(status)
      if (status === 400) expect(expectOpenAIError(res.json())).toMatchObject({ code: 'SHOAL_ERR_BAD_REQUEST' })
    }
    const many = await ingress.app.inject({ method: 'POST', url: '/v1/chat/completions', payload: { model: 'sim', messages: Array.from({ length: 2049 }, () => ({ role: 'user', content: 'a' })) } })
    expect(many.statusCode).toBe(400)
    expect(expectOpenAIError(many.json())).toMatchObject({ param: 'messages', message: expect.stringMatching(/2048/) })
    const lone = await post(`{"model":"sim","prompt":"${pad}\\ud800"}`)
    expect(lone.statusCode).toBe(400)
    expect(expectOpenAIError(lone.json())).toMatchObject({ param: 'prompt' })
  })
})

describe('body decoder fuzz', () => {
  let ingress: Ingress
  beforeAll(async () => {
    ingress = createIngress({ logger: false, bodyLimitBytes: 64 * 1024 }, { service: createSimulatedService({ models: [{ id: 'sim' }] }) })
    await ingress.app.ready()
  })
  afterAll(async () => { await ingress.stop() })

  const allowed = new Set([200, 400, 404, 413, 415])
  const check = async (url: string, payload: string, contentType = 'application/json'): Promise<void> => {
    const res = await ingress.app.inject({ method: 'POST', url, payload, headers: { 'content-type': contentType } })
    expect(allowed.has(res.statusCode), `${res.statusCode} for ${payload.slice(0, 200)}`).toBe(true)
    if (res.statusCode !== 200) expect(expectOpenAIError(res.json()).type).toBe('invalid_request_error')
  }

  /** Bodies near the valid ones: the right fields with arbitrary JSON values, plus strings with lone surrogates. */
  const anyValue = fc.oneof(fc.jsonValue({ maxDepth: 3 }), fc.string({ unit: 'binary', maxLength: 20 }), fc.constantFrom('a\ud800b', '\udfff', null, -1, 2 ** 40, 1e308, [2 ** 33]))
  const chatBody = fc.record({
    model: fc.oneof(fc.constant('sim'), anyValue),
    messages: fc.oneof(fc.array(fc.record({ role: fc.oneof(fc.constant('user'), anyValue), content: anyValue }, { requiredKeys: [] }), { maxLength: 3 }), anyValue),
    max_tokens: anyValue, temperature: anyValue, top_p: anyValue, stop: anyValue, n: anyValue, seed: anyValue, stream: fc.constantFrom(false, undefined),
  }, { requiredKeys: [] })
  const completionBody = fc.record({
    model: fc.oneof(fc.constant('sim'), anyValue),
    prompt: fc.oneof(fc.string({ maxLength: 30 }), fc.array(fc.integer({ min: -5, max: 2 ** 33 }), { maxLength: 5 }), anyValue),
    max_tokens: anyValue, echo: anyValue, logprobs: anyValue, stream: fc.constantFrom(false, undefined),
  }, { requiredKeys: [] })

  it('structured bodies: chat and completions', async () => {
    await fc.assert(fc.asyncProperty(chatBody, async (b) => { await check('/v1/chat/completions', JSON.stringify(b)) }), { numRuns: 150 })
    await fc.assert(fc.asyncProperty(completionBody, async (b) => { await check('/v1/completions', JSON.stringify(b)) }), { numRuns: 150 })
  })

  it('arbitrary bytes, truncated JSON and other content types', async () => {
    const valid = JSON.stringify({ model: 'sim', messages: [{ role: 'user', content: 'hi' }] })
    await fc.assert(fc.asyncProperty(
      fc.oneof(fc.string({ unit: 'binary', maxLength: 200 }), fc.nat({ max: valid.length }).map(n => valid.slice(0, n)), fc.json()),
      fc.constantFrom('application/json', 'text/plain', 'application/json; charset=utf-8'),
      async (payload, type) => { await check('/v1/chat/completions', payload, type) },
    ), { numRuns: 200 })
  })
})
