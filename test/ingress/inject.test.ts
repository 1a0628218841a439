/** Schema edge cases and the read-only routes, through fastify's inject(). */
import { afterAll, beforeAll, describe, expect, it } from 'vitest'
import { Counter, Registry } from 'prom-client'
import { createIngress, type Ingress } from '../../daemon/ingress/index.ts'
import { createSimulatedService, SIMULATED_DEFAULT_REPLY } from '../support/simulated-service.ts'
import { expectOpenAIError } from './harness.ts'

describe('ingress via inject()', () => {
  const service = createSimulatedService({ models: [{ id: 'sim', description: 'simulated engine (tests)' }] })
  const registry = new Registry()
  const receipts = new Map<string, unknown>([['r-1', { body: { id: 'r-1' }, signature: 'sig' }]])
  let ingress: Ingress
  beforeAll(async () => {
    new Counter({ name: 'other_module_total', help: 'registered by another module', registers: [registry] }).inc()
    ingress = createIngress({ logger: false }, {
      service,
      metrics: registry,
      receipts: { get: async (id) => receipts.get(id) },
      mesh: { snapshot: () => ({ self: { peerId: 'p1', name: 'n1' }, peers: [] }) },
    })
    await ingress.app.ready()
  })
  afterAll(async () => { await ingress.stop() })

  const chat = async (body: Record<string, unknown>) => await ingress.app.inject({
    method: 'POST', url: '/v1/chat/completions', payload: { model: 'sim', messages: [{ role: 'user', content: 'hi' }], ...body },
  })
  const completion = async (body: Record<string, unknown>) => await ingress.app.inject({
    method: 'POST', url: '/v1/completions', payload: { model: 'sim', prompt: 'hi', ...body },
  })
  const expect400 = (res: { statusCode: number, json: () => unknown }, param: string | null) => {
    expect(res.statusCode).toBe(400)
    expect(expectOpenAIError(res.json()).param).toBe(param)
  }

  it('ignores unknown fields and accepts explicit nulls', async () => {
    const res = await chat({ frobnicate: { deep: true }, temperature: null, stop: null, n: null, max_tokens: null, user: 'u', presence_penalty: 0 })
    expect(res.statusCode).toBe(200)
    expect(res.json().choices[0].message.content).toBe(SIMULATED_DEFAULT_REPLY)
  })

  it('does not coerce types', async () => {
    expect400(await chat({ max_tokens: '5' }), 'max_tokens')
    expect400(await chat({ stream: 'true' }), 'stream')
    expect400(await chat({ seed: 1.5 }), 'seed')
  })

  it('checks ranges and counts', async () => {
    expect400(await chat({ temperature: 2.5 }), 'temperature')
    expect400(await chat({ top_p: 0 }), 'top_p')
    expect400(await chat({ max_tokens: 0 }), 'max_tokens')
    expect400(await chat({ stop: ['a', 'b', 'c', 'd', 'e'] }), 'stop')
    expect400(await chat({ n: 0 }), 'n')
    expect((await chat({ n: 1, temperature: 0, top_p: 1, stop: 'x' })).statusCode).toBe(200)
  })

  it('names missing and nested params', async () => {
    const noModel = await ingress.app.inject({ method: 'POST', url: '/v1/chat/completions', payload: { messages: [] } })
    expect400(noModel, 'model')
    expect400(await chat({ messages: [] }), 'messages')
    expect400(await chat({ messages: [{ content: 'x' }] }), 'messages[0].role')
    expect400(await chat({ messages: [{ role: 'user', content: [{ type: 'image_url', image_url: { url: 'x' } }] }] }), 'messages[0].content[0].type')
    expect400(await chat({ messages: [{ role: 'user', content: [{ type: 'text' }] }] }), 'messages[0].content[0].text')
  })

  it('refuses what it does not support instead of ignoring it', async () => {
    expect400(await chat({ logprobs: true }), 'logprobs')
    expect400(await chat({ tools: [{ type: 'function', function: { name: 'f' } }] }), 'tools')
    expect400(await chat({ response_format: { type: 'json_object' } }), 'response_format')
    expect400(await chat({ frequency_penalty: 0.5 }), 'frequency_penalty')
    expect400(await completion({ echo: true }), 'echo')
    expect400(await completion({ logprobs: 2 }), 'logprobs')
    expect400(await completion({ best_of: 2 }), 'best_of')
    expect400(await completion({ prompt: [[1, 2], [3]] }), 'prompt')
    expect400(await completion({ prompt: [] }), 'prompt')
    expect400(await completion({ prompt: [1, -2] }), 'prompt[1]')
    expect400(await completion({ prompt: [1, 'a'] }), 'prompt')
    expect400(await completion({ prompt: 5 }), 'prompt')
    expect((await completion({ echo: false, best_of: 1, logprobs: null })).statusCode).toBe(200)
  })

  it('passes service bad-request errors through (token id outside the vocabulary)', async () => {
    const res = await completion({ prompt: [1, 300] })
    expect(res.statusCode).toBe(400)
    expect(expectOpenAIError(res.json()).code).toBe('SHOAL_ERR_BAD_REQUEST')
  })

  it('reshapes non-JSON bodies and empty bodies', async () => {
    const text = await ingress.app.inject({ method: 'POST', url: '/v1/completions', headers: { 'content-type': 'text/plain' }, payload: 'hello' })
    expect(text.statusCode).toBe(400)
    expectOpenAIError(text.json())
    const empty = await ingress.app.inject({ method: 'POST', url: '/v1/completions', headers: { 'content-type': 'application/json' }, payload: '' })
    expect(empty.statusCode).toBe(400)
    expectOpenAIError(empty.json())
  })

  it('writes OpenAI SSE on the wire', async () => {
    const res = await chat({ stream: true, max_tokens: 2 })
    expect(res.statusCode).toBe(200)
    expect(res.headers['content-type']).toMatch(/^text\/event-stream/)
    expect(res.body.endsWith('data: [DONE]\n\n')).toBe(true)
    const events = res.body.split('\n\n').filter(e => e !== '')
    expect(events.every(e => e.startsWith('data: '))).toBe(true)
    const chunks = events.slice(0, -1).map(e => JSON.parse(e.slice(6)))
    expect(chunks.map(c => c.choices[0].delta)).toEqual([{ role: 'assistant', content: '' }, { content: 'H' }, { content: 'e' }, {}])
    expect(chunks.at(-1).shoal.receipt_id).toBe(res.headers['x-shoal-receipt'])
    expect(chunks.at(-1).choices[0].finish_reason).toBe('length')
  })

  it('serves receipts by id, and 404s unknown ones', async () => {
    const ok = await ingress.app.inject({ method: 'GET', url: '/v1/receipts/r-1' })
    expect(ok.statusCode).toBe(200)
    expect(ok.json()).toEqual({ body: { id: 'r-1' }, signature: 'sig' })
    const missing = await ingress.app.inject({ method: 'GET', url: '/v1/receipts/nope' })
    expect(missing.statusCode).toBe(404)
    expect(expectOpenAIError(missing.json()).code).toBe('SHOAL_ERR_NOT_FOUND')
  })

  it('serves the mesh snapshot, health and models', async () => {
    expect((await ingress.app.inject({ method: 'GET', url: '/v1/mesh' })).json()).toEqual({ self: { peerId: 'p1', name: 'n1' }, peers: [] })
    expect((await ingress.app.inject({ method: 'GET', url: '/healthz' })).json()).toEqual({ status: 'ok' })
    const models = (await ingress.app.inject({ method: 'GET', url: '/v1/models' })).json()
    expect(models).toEqual({
      object: 'list',
      data: [{ id: 'sim', object: 'model', created: 1_700_000_000, owned_by: 'shoal', context_length: 2048, description: 'simulated engine (tests)', served_by: ['sim-node'] }],
    })
  })

  it('exposes Prometheus metrics in the shared registry', async () => {
    await chat({ stream: true })
    const res = await ingress.app.inject({ method: 'GET', url: '/metrics' })
    expect(res.statusCode).toBe(200)
    expect(res.headers['content-type']).toMatch(/^text\/plain/)
    const text = res.body
    expect(text).toContain('other_module_total 1')
    expect(text).toMatch(/shoal_http_requests_total\{method="POST",route="\/v1\/chat\/completions",status="200"\} \d+/)
    expect(text).toMatch(/shoal_http_requests_total\{method="POST",route="\/v1\/chat\/completions",status="400"\} \d+/)
    expect(text).toMatch(/shoal_time_to_first_token_seconds_count\{model="sim"\} [1-9]/)
    expect(text).toMatch(/shoal_inter_token_seconds_count\{model="sim"\} [1-9]/)
    expect(text).toMatch(/shoal_tokens_generated_total\{model="sim"\} [1-9]/)
    expect(text).toContain('shoal_http_requests_in_flight')
  })

  it('a second ingress on the same registry reuses the metrics', () => {
    expect(() => createIngress({ logger: false }, { service, metrics: registry })).not.toThrow()
  })

  it('404s receipts and mesh when those components are absent', async () => {
    const bare = createIngress({ logger: false }, { service })
    for (const url of ['/v1/receipts/x', '/v1/mesh']) {
      const res = await bare.app.inject({ method: 'GET', url })
      expect(res.statusCode).toBe(404)
      expectOpenAIError(res.json())
    }
    await bare.app.close()
  })
})
