/** The main paths through the real openai client over a real socket. */
import { afterAll, beforeAll, describe, expect, it } from 'vitest'
import { APIUserAbortError } from 'openai'
import { type Harness, startHarness } from './harness.ts'
import { SIMULATED_DEFAULT_REPLY, simulatedPromptIds } from '../support/simulated-service.ts'

const LONG = 'The quick brown fox jumps over the lazy dog. '.repeat(20)

describe('ingress with the openai client', () => {
  let h: Harness
  beforeAll(async () => {
    h = await startHarness({
      // Streams 5 tokens, then waits for an abort that the cancellation test provides.
      held: { reply: LONG, hold: { afterTokens: 5, until: new Promise(() => {}) } },
      routed: { route: ['peerA', 'peerB'], reply: 'chained' },
    })
  })
  afterAll(async () => { await h.stop() })

  it('lists models in OpenAI shape with shoal extras', async () => {
    const page = await h.client.models.list()
    const sim = page.data.find(m => m.id === 'sim') as unknown as Record<string, unknown>
    expect(sim).toMatchObject({ id: 'sim', object: 'model', owned_by: 'shoal', context_length: 2048, served_by: ['sim-node'] })
    expect(typeof sim.created).toBe('number')
  })

  it('answers a chat completion with usage, receipt and route headers', async () => {
    const messages = [{ role: 'system' as const, content: 'be brief' }, { role: 'user' as const, content: 'hi' }]
    const { data, response } = await h.client.chat.completions.create({ model: 'routed', messages }).withResponse()
    expect(data.object).toBe('chat.completion')
    expect(data.id).toMatch(/^chatcmpl-/)
    expect(data.choices).toEqual([{ index: 0, message: { role: 'assistant', content: 'chained', refusal: null }, logprobs: null, finish_reason: 'stop' }])
    const promptTokens = simulatedPromptIds({ kind: 'chat', messages }).length
    expect(data.usage).toEqual({ prompt_tokens: promptTokens, completion_tokens: 7, total_tokens: promptTokens + 7 })
    expect(response.headers.get('x-shoal-route')).toBe('peerA,peerB')
    const receipt = response.headers.get('x-shoal-receipt')
    expect(receipt).toMatch(/^[0-9a-f-]{36}$/)
    expect(data.id).toBe(`chatcmpl-${receipt}`)
    const call = h.service.calls.find(c => c.request.requestId === receipt)
    expect(call?.request.prompt).toEqual({ kind: 'chat', messages })
  })

  it('joins text content parts and passes sampling, seed, stop and max tokens through', async () => {
    const data = await h.client.chat.completions.create({
      model: 'sim',
      messages: [{ role: 'user', content: [{ type: 'text', text: 'Hello, ' }, { type: 'text', text: 'world' }] }],
      temperature: 0.5, top_p: 0.9, seed: 7, stop: ['engine'], max_completion_tokens: 100,
    })
    expect(data.choices[0]?.message.content).toBe('Hello from the simulated ')
    expect(data.choices[0]?.finish_reason).toBe('stop')
    const req = h.service.calls.at(-1)!.request
    expect(req.prompt).toEqual({ kind: 'chat', messages: [{ role: 'user', content: 'Hello, world' }] })
    expect(req.sampling).toEqual({ temperature: 0.5, topP: 0.9, seed: 7 })
    expect(req.stop).toEqual(['engine'])
    expect(req.maxTokens).toBe(100)
  })

  it('stops at max_tokens with finish_reason length', async () => {
    const data = await h.client.chat.completions.create({ model: 'sim', messages: [{ role: 'user', content: 'x' }], max_tokens: 5 })
    expect(data.choices[0]?.message.content).toBe(SIMULATED_DEFAULT_REPLY.slice(0, 5))
    expect(data.choices[0]?.finish_reason).toBe('length')
    expect(data.usage?.completion_tokens).toBe(5)
  })

  it('streams a chat completion: role first, content, finish, usage last, receipt on the last event', async () => {
    const { data: stream, response } = await h.client.chat.completions.create({
      model: 'sim', messages: [{ role: 'user', content: 'hi' }], stream: true, stream_options: { include_usage: true },
    }).withResponse()
    const receipt = response.headers.get('x-shoal-receipt')
    expect(receipt).toBeTruthy()
    expect(response.headers.get('x-shoal-route')).toBe('sim-node')
    const chunks = []
    for await (const chunk of stream) chunks.push(chunk)
    expect(chunks[0]?.choices).toEqual([{ index: 0, delta: { role: 'assistant', content: '' }, logprobs: null, finish_reason: null }])
    for (const c of chunks) {
      expect(c.object).toBe('chat.completion.chunk')
      expect(c.id).toBe(`chatcmpl-${receipt}`)
    }
    const text = chunks.map(c => c.choices[0]?.delta.content ?? '').join('')
    expect(text).toBe(SIMULATED_DEFAULT_REPLY)
    const last = chunks.at(-1)!
    expect(last.choices).toEqual([])
    const prompt = simulatedPromptIds({ kind: 'chat', messages: [{ role: 'user', content: 'hi' }] }).length
    const n = new TextEncoder().encode(SIMULATED_DEFAULT_REPLY).length
    expect(last.usage).toEqual({ prompt_tokens: prompt, completion_tokens: n, total_tokens: prompt + n })
    expect((last as unknown as { shoal: unknown }).shoal).toEqual({ receipt_id: receipt, route: ['sim-node'] })
    expect(chunks.at(-2)?.choices[0]?.finish_reason).toBe('stop')
    expect(chunks.slice(0, -1).every(c => c.usage === null)).toBe(true)
  })

  it('streams without include_usage: the finish chunk names the receipt and no usage chunk follows', async () => {
    const stream = await h.client.chat.completions.create({ model: 'sim', messages: [{ role: 'user', content: 'hi' }], stream: true, max_tokens: 3 })
    const chunks = []
    for await (const chunk of stream) chunks.push(chunk)
    const last = chunks.at(-1)!
    expect(last.choices[0]?.finish_reason).toBe('length')
    expect(last.usage).toBeUndefined()
    expect((last as unknown as { shoal: { receipt_id: string } }).shoal.receipt_id).toMatch(/^[0-9a-f-]{36}$/)
  })

  it('completes a token-id prompt with return_token_ids (vLLM extension)', async () => {
    const params = { model: 'sim', prompt: [72, 105], max_tokens: 4, return_token_ids: true }
    const { data, response } = await h.client.completions.create(params).withResponse()
    expect(data.object).toBe('text_completion')
    expect(data.id).toMatch(/^cmpl-/)
    const choice = data.choices[0] as unknown as Record<string, unknown>
    expect(choice).toMatchObject({ index: 0, text: 'Hell', finish_reason: 'length', logprobs: null })
    expect(choice.prompt_token_ids).toEqual([72, 105])
    expect(choice.token_ids).toEqual([...new TextEncoder().encode('Hell')])
    expect(data.usage).toEqual({ prompt_tokens: 2, completion_tokens: 4, total_tokens: 6 })
    expect(response.headers.get('x-shoal-receipt')).toBeTruthy()
    expect(h.service.calls.at(-1)!.request.prompt).toEqual({ kind: 'tokens', ids: [72, 105] })
  })

  it('completes a text prompt (default 16 tokens, no token ids unless asked)', async () => {
    const data = await h.client.completions.create({ model: 'sim', prompt: 'Say:' })
    const choice = data.choices[0] as unknown as Record<string, unknown>
    expect(choice.text).toBe(SIMULATED_DEFAULT_REPLY.slice(0, 16))
    expect(choice).not.toHaveProperty('token_ids')
    expect(h.service.calls.at(-1)!.request.prompt).toEqual({ kind: 'text', text: 'Say:' })
  })

  it('streams a completion with token ids per chunk and prompt ids on the first', async () => {
    const params = { model: 'sim', prompt: 'ab', stream: true as const, max_tokens: 6, return_token_ids: true, stream_options: { include_usage: true } }
    const stream = await h.client.completions.create(params)
    const chunks = []
    for await (const chunk of stream) chunks.push(chunk as unknown as { choices: Array<Record<string, unknown>>, usage: unknown, object: string })
    expect(chunks.every(c => c.object === 'text_completion')).toBe(true)
    expect(chunks[0]?.choices[0]?.prompt_token_ids).toEqual([97, 98])
    const withChoice = chunks.filter(c => c.choices.length > 0)
    expect(withChoice.map(c => c.choices[0]?.text).join('')).toBe(SIMULATED_DEFAULT_REPLY.slice(0, 6))
    expect(withChoice.flatMap(c => c.choices[0]?.token_ids as number[])).toEqual([...new TextEncoder().encode(SIMULATED_DEFAULT_REPLY.slice(0, 6))])
    expect(chunks.at(-1)?.usage).toEqual({ prompt_tokens: 2, completion_tokens: 6, total_tokens: 8 })
  })

  it('a client abort mid-stream cancels the generation', async () => {
    const ac = new AbortController()
    const stream = await h.client.chat.completions.create({ model: 'held', messages: [{ role: 'user', content: 'go' }], stream: true }, { signal: ac.signal })
    const call = h.service.calls.at(-1)!
    let seen = 0
    try {
      for await (const _chunk of stream) {
        if (++seen === 3) ac.abort()
      }
    } catch (err) {
      // Depending on timing the client either ends the iteration quietly or throws its abort error.
      expect(err).toBeInstanceOf(APIUserAbortError)
    }
    expect(seen).toBeLessThanOrEqual(6)
    expect(await call.outcome).toBe('aborted')
    expect(call.signal.aborted).toBe(true)
    // and the server goes on serving
    const after = await h.client.chat.completions.create({ model: 'sim', messages: [{ role: 'user', content: 'again' }] })
    expect(after.choices[0]?.message.content).toBe(SIMULATED_DEFAULT_REPLY)
  })

  it('a completed request does not look like a client abort to the service', async () => {
    await h.client.chat.completions.create({ model: 'sim', messages: [{ role: 'user', content: 'x' }] })
    const call = h.service.calls.at(-1)!
    expect(await call.outcome).toBe('completed')
    expect(call.signal.aborted).toBe(false)
  })
})
