/**
 * Fuzz of the /shoal/infer frame reader on a real libp2p stream pair (@libp2p/utils streamPair):
 * whatever bytes a peer writes, in whatever chunks, the reader yields the frames they hold, then
 * null at a clean end — or fails with an InferWireError (a bad frame, a length over the cap, a
 * stream ending inside a frame). It never hangs and never buffers past what a frame may hold.
 */
import fc from 'fast-check'
import { streamPair } from '@libp2p/utils'
import { describe, expect, it } from 'vitest'
import { encodeFrame } from '../../daemon/routing/index.ts'
import type { InferFrame } from '../../daemon/routing/index.ts'
import { createFrameReader } from '../../daemon/routing/frame-stream.ts'
import { near, reportRuns, runs } from './fuzz.ts'

reportRuns(import.meta.filename)

const frames: InferFrame[] = [
  { kind: 'delta', requestId: 'r1', event: { type: 'delta', text: 'hé', tokenIds: [300, 5] } },
  { kind: 'end', requestId: 'r1', event: { type: 'end', finishReason: 'stop', usage: { promptTokens: 2, completionTokens: 2 } } },
  { kind: 'error', requestId: 'r1', error: { name: 'ShoalError', code: 'SHOAL_ERR_OVERLOADED', message: 'busy' } },
  { kind: 'cancel', requestId: 'r1' },
]
const valid = fc.array(fc.constantFrom(...frames), { minLength: 1, maxLength: 4 }).map(fs => Uint8Array.from(fs.flatMap(f => [...encodeFrame(f)])))
const CAP = 1024

/** Writes `bytes` in the given chunk sizes, closes the writing side, and reads everything back. */
async function readAll (bytes: Uint8Array, chunks: number[]): Promise<{ frames: InferFrame[], error?: { name?: string, code?: string } }> {
  const [a, b] = await streamPair()
  const reader = createFrameReader(b, CAP)
  const got: InferFrame[] = []
  const writing = (async () => {
    let at = 0
    for (const n of [...chunks, bytes.length]) {
      if (at >= bytes.length) break
      const chunk = bytes.subarray(at, Math.min(bytes.length, at + Math.max(1, n)))
      at += chunk.length
      if (a.status !== 'open') return
      if (!a.send(chunk)) await a.onDrain({ signal: AbortSignal.timeout(5_000) })
    }
    await a.close({ signal: AbortSignal.timeout(5_000) })
  })().catch(() => { /* the reader aborted the stream: expected after a bad frame */ })
  try {
    // A hang would show as this signal's TimeoutError, which is not an InferWireError.
    const signal = AbortSignal.timeout(10_000)
    while (true) {
      const f = await reader.next(signal)
      if (f === null) return { frames: got }
      got.push(f)
    }
  } catch (err) {
    return { frames: got, error: err as { name?: string, code?: string } }
  } finally {
    reader.dispose()
    await writing
    b.abort(new Error('done'))
    a.abort(new Error('done'))
  }
}

const chunking = fc.array(fc.integer({ min: 1, max: 40 }), { maxLength: 8 })

describe('infer frame reader on a real stream', () => {
  it('valid frames in any chunking come out whole and in order, then a clean end', async () => {
    await fc.assert(fc.asyncProperty(valid, chunking, async (bytes, chunks) => {
      const r = await readAll(bytes, chunks)
      expect(r.error).toBeUndefined()
      expect(r.frames.map(f => Uint8Array.from(encodeFrame(f))).flatMap(x => [...x])).toEqual([...bytes])
    }), runs('infer reader: valid frames, any chunking', 40))
  })

  it('arbitrary bytes and bytes near valid frames: frames, a clean end, or an InferWireError — never a hang', async () => {
    const input = fc.oneof(fc.uint8Array({ minLength: 1, maxLength: 200 }), valid.chain(near),
      // A length prefix claiming far more than the cap, then a little data.
      fc.tuple(fc.integer({ min: CAP + 1, max: 2 ** 48 }), fc.uint8Array({ maxLength: 16 })).map(([claim, rest]) => {
        const prefix: number[] = []
        let n = claim
        while (n >= 0x80) { prefix.push((n % 128) | 0x80); n = Math.floor(n / 128) }
        prefix.push(n)
        return Uint8Array.from([...prefix, ...rest])
      }))
    const seen = { frames: 0, errors: 0 }
    await fc.assert(fc.asyncProperty(input, chunking, async (bytes, chunks) => {
      const r = await readAll(bytes, chunks)
      seen.frames += r.frames.length
      if (r.error !== undefined) {
        seen.errors++
        expect(r.error.name, `${String(r.error.name)} ${String(r.error.code)} for ${Buffer.from(bytes).toString('hex')}`).toBe('InferWireError')
        expect(r.error.code).toMatch(/^SHOAL_ERR_INFER_/)
      }
    }), runs('infer reader: arbitrary and near-valid bytes', 80))
    // Both ways out were taken: the property is not vacuous.
    expect(seen.frames).toBeGreaterThan(0)
    expect(seen.errors).toBeGreaterThan(0)
  })
})
