/**
 * The benchmarks' stream reader (reproduction/sse.ts): events split across chunks, token chunks
 * in order, chunks without ids passed over, `[DONE]` ends it, an error event throws.
 */
import { describe, expect, it } from 'vitest'
import { sseEvents, tokenChunks } from '../../reproduction/sse.ts'

const body = (...parts: string[]): ReadableStream<Uint8Array> => new ReadableStream({
  start (c) { for (const p of parts) c.enqueue(new TextEncoder().encode(p)); c.close() },
})
const chunk = (ids: number[]): string => `data: ${JSON.stringify({ choices: [{ text: 'x', token_ids: ids, finish_reason: null }] })}\n\n`

describe('reproduction sse', () => {
  it('splits events on blank lines across chunk boundaries', async () => {
    const out: string[] = []
    for await (const e of sseEvents(body('data: a\n', '\ndata: b\n\nda', 'ta: c\n\n'))) out.push(e)
    expect(out).toEqual(['data: a', 'data: b', 'data: c'])
  })

  it('gives the token ids chunk by chunk and stops at [DONE]', async () => {
    const whole = chunk([1, 2]) + ': keep-alive\n\n' + chunk([]) + chunk([3])
    const got: number[][] = []
    for await (const c of tokenChunks(body(whole.slice(0, 17), whole.slice(17), 'data: [DONE]\n\n', chunk([9])), 'here')) {
      expect(typeof c.at).toBe('number')
      got.push(c.ids)
    }
    expect(got).toEqual([[1, 2], [3]])
  })

  it('throws on an error event, naming where it came from', async () => {
    const read = async (): Promise<void> => { for await (const _ of tokenChunks(body(chunk([1]), 'data: {"error":{"message":"boom"}}\n\n'), 'http://a')) { /* drain */ } }
    await expect(read()).rejects.toThrow(/stream error from http:\/\/a: .*boom/)
  })
})
