/** stop(): new requests get 503 while running ones finish; a drain that runs out of time aborts them. */
import { describe, expect, it, vi } from 'vitest'
import { APIError } from 'openai'
import { expectOpenAIError, startHarness } from './harness.ts'

const REPLY = 'draining politely, one token at a time'

describe('ingress lifecycle', () => {
  it('answers 503 to new requests while stopping, and lets the running stream finish', async () => {
    let release = (): void => {}
    const until = new Promise<void>(resolve => { release = resolve })
    // The stream pauses after 3 tokens until the 503s have been checked.
    const h = await startHarness({ slow: { reply: REPLY, hold: { afterTokens: 3, until } } })
    const stream = await h.client.chat.completions.create({ model: 'slow', messages: [{ role: 'user', content: 'go' }], stream: true })
    const it = stream[Symbol.asyncIterator]()
    let text = ''
    const first = await it.next()
    expect(first.done).toBe(false)

    const stopped = h.stop()
    const err = await h.client.chat.completions.create({ model: 'sim', messages: [{ role: 'user', content: 'late' }] }).catch((e: unknown) => e)
    expect(err).toBeInstanceOf(APIError)
    expect((err as APIError).status).toBe(503)
    expect(expectOpenAIError({ error: (err as APIError).error }).code).toBe('SHOAL_ERR_SHUTTING_DOWN')
    const health = await fetch(`${h.url}/healthz`)
    expect(health.status).toBe(503)
    await health.body?.cancel()

    release()
    for (let r = await it.next(); r.done !== true; r = await it.next()) text += r.value.choices[0]?.delta.content ?? ''
    expect(text).toBe(REPLY)
    await stopped
    expect(await h.service.calls[0]?.outcome).toBe('completed')
  })

  it('aborts what is still running when the drain time is up', async () => {
    const h = await startHarness({ stall: { stallBeforeStart: 'until-abort' } }, { drainTimeoutMs: 50 })
    const pending = h.client.completions.create({ model: 'stall', prompt: 'x' }).catch((e: unknown) => e)
    await vi.waitFor(() => { expect(h.service.calls.length).toBe(1) })
    await h.stop()
    const err = await pending
    expect(err).toBeInstanceOf(APIError)
    expect((err as APIError).status).toBe(503)
    expect((err as APIError).code).toBe('SHOAL_ERR_SHUTTING_DOWN')
    expect(await h.service.calls[0]?.outcome).toBe('aborted')
  })

  it('stop() twice is one stop', async () => {
    const h = await startHarness()
    await Promise.all([h.stop(), h.stop()])
    await h.stop()
  })
})
