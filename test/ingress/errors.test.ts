/**
 * Every error status of the contract over a real socket, each in OpenAI's shape, and the server
 * answering normally after each one.
 */
import { afterAll, afterEach, beforeAll, describe, expect, it, vi } from 'vitest'
import { APIError } from 'openai'
import { type Harness, expectOpenAIError, readSse, startHarness } from './harness.ts'
import { SIMULATED_DEFAULT_REPLY } from '../support/simulated-service.ts'
import type { ShoalErrorCode } from '../../daemon/errors.ts'

async function apiError (p: Promise<unknown>): Promise<APIError> {
  try {
    await p
  } catch (err) {
    if (err instanceof APIError) return err
    throw err
  }
  throw new Error('expected an API error')
}

describe('ingress errors', () => {
  let h: Harness
  const user = [{ role: 'user' as const, content: 'hi' }]

  beforeAll(async () => {
    h = await startHarness({
      tiny: { contextLength: 32 },
      'no-node': { failBeforeStart: 'SHOAL_ERR_NO_ELIGIBLE_NODE' },
      'late-deadline': { failBeforeStart: 'SHOAL_ERR_DEADLINE' },
      'dies-midway': { failAfterTokens: 3, failCode: 'SHOAL_ERR_NO_ELIGIBLE_NODE' },
      'internal-midway': { failAfterTokens: 2, failCode: 'SOMETHING_ELSE' as ShoalErrorCode }, // a code no build lists
      stall: { stallBeforeStart: 'until-abort' },
    }, { bodyLimitBytes: 16 * 1024, maxConcurrentRequests: 2 })
  })
  afterAll(async () => { await h.stop() })

  // The server keeps serving after every error.
  afterEach(async () => {
    const ok = await h.client.chat.completions.create({ model: 'sim', messages: user })
    expect(ok.choices[0]?.message.content).toBe(SIMULATED_DEFAULT_REPLY)
  })

  const post = async (path: string, body: string, type = 'application/json'): Promise<Response> =>
    await fetch(`${h.url}${path}`, { method: 'POST', headers: { 'content-type': type }, body })

  it('400 for malformed JSON', async () => {
    const res = await post('/v1/chat/completions', '{"model": "sim", "messages": [')
    expect(res.status).toBe(400)
    const e = expectOpenAIError(await res.json())
    expect(e).toMatchObject({ type: 'invalid_request_error', code: 'SHOAL_ERR_BAD_REQUEST', param: null })
    expect(e.message).toMatch(/JSON/)
  })

  it('400 for a wrong type, naming the param', async () => {
    const err = await apiError(h.client.chat.completions.create({ model: 'sim', messages: user, temperature: 'hot' as unknown as number }))
    expect(err.status).toBe(400)
    expect(expectOpenAIError({ error: err.error })).toMatchObject({ param: 'temperature', type: 'invalid_request_error' })
  })

  it('400 for a bad message content type, naming the nested param', async () => {
    const err = await apiError(h.client.chat.completions.create({ model: 'sim', messages: [{ role: 'user', content: 5 as unknown as string }] }))
    expect(err.status).toBe(400)
    expect(err.param).toBe('messages[0].content')
  })

  it('400 for n > 1', async () => {
    const err = await apiError(h.client.chat.completions.create({ model: 'sim', messages: user, n: 2 }))
    expect(err.status).toBe(400)
    expect(err.param).toBe('n')
    expect(err.code).toBe('SHOAL_ERR_UNSUPPORTED_PARAMETER')
  })

  it('400 for batched completion prompts', async () => {
    const err = await apiError(h.client.completions.create({ model: 'sim', prompt: ['a', 'b'] }))
    expect(err.status).toBe(400)
    expect(err.param).toBe('prompt')
  })

  it('404 for an unknown model', async () => {
    const err = await apiError(h.client.chat.completions.create({ model: 'nope', messages: user }))
    expect(err.status).toBe(404)
    expect(expectOpenAIError({ error: err.error })).toMatchObject({ code: 'SHOAL_ERR_MODEL_NOT_FOUND', type: 'invalid_request_error' })
  })

  it('404 for an unknown route', async () => {
    const res = await fetch(`${h.url}/v1/embeddings`, { method: 'POST', headers: { 'content-type': 'application/json' }, body: '{}' })
    expect(res.status).toBe(404)
    expect(expectOpenAIError(await res.json()).code).toBe('SHOAL_ERR_NOT_FOUND')
  })

  it('413 when the prompt exceeds the context', async () => {
    const err = await apiError(h.client.chat.completions.create({ model: 'tiny', messages: [{ role: 'user', content: 'x'.repeat(100) }] }))
    expect(err.status).toBe(413)
    expect(err.code).toBe('SHOAL_ERR_CONTEXT_LENGTH')
  })

  it('413 when the body is larger than the limit', async () => {
    const err = await apiError(h.client.chat.completions.create({ model: 'sim', messages: [{ role: 'user', content: 'x'.repeat(64 * 1024) }] }))
    expect(err.status).toBe(413)
    expect(expectOpenAIError({ error: err.error }).code).toBe('SHOAL_ERR_BODY_TOO_LARGE')
  })

  it('429 with Retry-After when too many requests are in flight', async () => {
    const holders = [new AbortController(), new AbortController()]
    const held = holders.map(async ac => await h.client.chat.completions.create({ model: 'stall', messages: user }, { signal: ac.signal }).catch(() => {}))
    const before = h.service.calls.length
    await vi.waitFor(() => { expect(h.service.calls.length).toBe(before + 2) })
    const err = await apiError(h.client.chat.completions.create({ model: 'sim', messages: user }))
    expect(err.status).toBe(429)
    expect(err.headers?.get('retry-after')).toBe('1')
    expect(expectOpenAIError({ error: err.error })).toMatchObject({ type: 'rate_limit_error', code: 'SHOAL_ERR_OVERLOADED' })
    for (const ac of holders) ac.abort()
    await Promise.all(held)
    for (const call of h.service.calls.slice(before)) expect(await call.outcome).toBe('aborted')
  })

  it('503 with Retry-After when no node is eligible', async () => {
    const err = await apiError(h.client.chat.completions.create({ model: 'no-node', messages: user }))
    expect(err.status).toBe(503)
    expect(err.headers?.get('retry-after')).toBe('1')
    expect(expectOpenAIError({ error: err.error })).toMatchObject({ type: 'server_error', code: 'SHOAL_ERR_NO_ELIGIBLE_NODE' })
  })

  it('504 when the service reports the deadline passed', async () => {
    const err = await apiError(h.client.completions.create({ model: 'late-deadline', prompt: 'x' }))
    expect(err.status).toBe(504)
    expect(err.code).toBe('SHOAL_ERR_DEADLINE')
  })

  it('an error after start ends the stream with an error event, never a silent truncation', async () => {
    const stream = await h.client.chat.completions.create({ model: 'dies-midway', messages: user, stream: true })
    let text = ''
    const err = await apiError((async () => { for await (const c of stream) text += c.choices[0]?.delta.content ?? '' })())
    expect(text).toBe(SIMULATED_DEFAULT_REPLY.slice(0, 3))
    expect(expectOpenAIError({ error: err.error })).toMatchObject({ code: 'SHOAL_ERR_NO_ELIGIBLE_NODE', type: 'server_error' })
  })

  it('on the wire: the error event comes before [DONE]; unknown errors hide their message', async () => {
    const res = await post('/v1/completions', JSON.stringify({ model: 'internal-midway', prompt: 'x', stream: true }))
    expect(res.status).toBe(200)
    expect(res.headers.get('x-shoal-receipt')).toBeTruthy()
    const events = await readSse(res)
    expect(events.at(-1)).toBe('[DONE]')
    const e = expectOpenAIError(JSON.parse(events.at(-2)!))
    expect(e).toEqual({ message: 'Internal server error', type: 'server_error', param: null, code: 'SHOAL_ERR_INTERNAL' })
    expect(events.slice(0, -2).map(d => (JSON.parse(d) as { choices: Array<{ text: string }> }).choices[0]?.text).join('')).toBe(SIMULATED_DEFAULT_REPLY.slice(0, 2))
  })

  it('an error after start without streaming is a real HTTP error that names no receipt (none was written)', async () => {
    const { response } = await h.client.chat.completions.create({ model: 'dies-midway', messages: user }).withResponse().catch((err: APIError) => ({ response: err }))
    const err = response as APIError
    expect(err.status).toBe(503)
    expect(err.headers?.get('x-shoal-receipt')).toBeNull()
    expect(err.headers?.get('x-request-id')).toBeTruthy()
  })

  it('an internal error keeps its message from the client whole too (e.g. one relayed from a peer)', async () => {
    const res = await post('/v1/completions', JSON.stringify({ model: 'internal-midway', prompt: 'x' }))
    expect(res.status).toBe(500)
    expect(res.headers.get('x-shoal-receipt')).toBeNull()
    expect(expectOpenAIError(await res.json())).toEqual({ message: 'Internal server error', type: 'server_error', param: null, code: 'SHOAL_ERR_INTERNAL' })
  })

  it('400 for a lone surrogate anywhere in the body, naming the field, before the service sees it (issue 13 #3)', async () => {
    const before = h.service.calls.length
    const chat = await post('/v1/chat/completions', '{"model":"sim","messages":[{"role":"user","content":"a\\ud800b"}]}')
    expect(chat.status).toBe(400)
    expect(expectOpenAIError(await chat.json())).toMatchObject({ code: 'SHOAL_ERR_BAD_REQUEST', param: 'messages[0].content' })
    const completion = await post('/v1/completions', '{"model":"sim","prompt":"x","stop":["\\udc00"]}')
    expect(completion.status).toBe(400)
    expect(expectOpenAIError(await completion.json())).toMatchObject({ code: 'SHOAL_ERR_BAD_REQUEST', param: 'stop[0]' })
    // A well-formed pair is text.
    const pair = await post('/v1/completions', '{"model":"sim","prompt":"\\ud83d\\ude00"}')
    expect(pair.status).toBe(200)
    expect(h.service.calls.length).toBe(before + 1)
  })

  it('400 for a token id no vocabulary holds (≥ 2^32), before the service sees it (issue 13 #4)', async () => {
    const res = await post('/v1/completions', JSON.stringify({ model: 'sim', prompt: [1, 2 ** 32] }))
    expect(res.status).toBe(400)
    expect(expectOpenAIError(await res.json())).toMatchObject({ code: 'SHOAL_ERR_BAD_REQUEST', param: 'prompt[1]' })
  })
})

describe('ingress deadline', () => {
  let h: Harness
  beforeAll(async () => { h = await startHarness({ hung: { stallBeforeStart: 'forever' } }, { requestTimeoutMs: 300 }) })
  afterAll(async () => { await h.stop() })

  it('504 when a service ignores its signal and the deadline passes', async () => {
    const err = await apiError(h.client.chat.completions.create({ model: 'hung', messages: [{ role: 'user', content: 'hi' }] }))
    expect(err.status).toBe(504)
    expect(expectOpenAIError({ error: err.error })).toMatchObject({ code: 'SHOAL_ERR_DEADLINE', type: 'server_error' })
    // Still serving (a cheap route: a completion could itself run into the short deadline on a busy machine).
    expect((await h.client.models.list()).data.map(m => m.id)).toContain('hung')
  })
})
