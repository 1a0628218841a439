/**
 * Fuzz of the stream framing on a real libp2p stream pair (@libp2p/utils streamPair).
 * /shoal/infer: whatever bytes a peer writes, in whatever chunks, the reader yields the frames they
 * hold, then null at a clean end — or fails with an InferWireError (a bad frame, a length over the
 * cap, a stream ending inside a frame). It never hangs and never buffers past what a frame may hold.
 * /shoal/stage: the links' splitter hands on only well-formed frames, answers each bad one with an
 * error frame carrying a SHOAL_ERR_STAGE_* code, and drops the stream on a length past the cap.
 */
import fc from 'fast-check'
import { streamPair } from '@libp2p/utils'
import { describe, expect, it } from 'vitest'
import { encodeFrame } from '../../daemon/routing/index.ts'
import type { InferFrame } from '../../daemon/routing/index.ts'
import { createFrameReader } from '../../daemon/routing/frame-stream.ts'
import { decodePayload as decodeStage, encodeFrame as encodeStage, encodePayloadParts as stageParts, STAGE_PROTOCOL } from '../../daemon/pipeline/index.ts'
import { createLinks } from '../../daemon/pipeline/links.ts'
import type { StageFrame } from '../../daemon/pipeline/index.ts'
import { peerIdFromString } from '@libp2p/peer-id'
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

describe('stage links on a real stream', () => {
  const PEER = '12D3KooWDpJ7As7BWAwRMfu1VU2WCqNjvq387JEYKDBj4kx6nXTN'
  const good: StageFrame[] = [
    { kind: 'token', requestId: 'r1', position: 3, tokenId: 7 },
    { kind: 'activation', requestId: 'r1', start: 0, final: true, rows: 1, width: 2, data: Float32Array.from([1, 2]) },
    { kind: 'cancel', requestId: 'r2' },
  ]
  const validStage = fc.array(fc.constantFrom(...good), { minLength: 1, maxLength: 3 }).map(fs => Uint8Array.from(fs.flatMap(f => [...encodeStage(f)])))

  /** Feeds `bytes` to a link's inbound side; returns the frames handed on and what the link wrote back. */
  async function feed (bytes: Uint8Array, chunks: number[]): Promise<{ frames: StageFrame[], replies: StageFrame[] }> {
    let handler: ((stream: any, connection: any) => void) | undefined
    const links = createLinks({
      peerId: 'self',
      handle: async (protocol, h) => { expect(protocol).toBe(STAGE_PROTOCOL); handler = h as typeof handler },
      openStream: async () => { throw new Error('not in this test') },
    }, { delayMs: 0 })
    const frames: StageFrame[] = []
    links.onFrame((f) => { frames.push(f) })
    await links.start()
    const [a, b] = await streamPair()
    handler!(b, { remotePeer: peerIdFromString(PEER) })
    const back: Uint8Array[] = []
    a.addEventListener('message', (evt) => { back.push((evt as unknown as { data: { subarray: () => Uint8Array } }).data.subarray()) })
    let at = 0
    for (const n of [...chunks, bytes.length]) {
      if (at >= bytes.length || a.status !== 'open') break
      const chunk = bytes.subarray(at, Math.min(bytes.length, at + Math.max(1, n)))
      at += chunk.length
      if (!a.send(chunk)) await a.onDrain({ signal: AbortSignal.timeout(5_000) }).catch(() => {})
    }
    // Let the last messages and any replies (and a fatal error's delayed abort) arrive.
    await new Promise(resolve => setTimeout(resolve, 60))
    await links.stop()
    a.abort(new Error('done'))
    const replies: StageFrame[] = []
    const all = Uint8Array.from(back.flatMap(x => [...x]))
    let o = 0
    while (o < all.length) {
      let len = 0; let scale = 1; let i = o
      for (; ; i++) { len += (all[i]! & 0x7f) * scale; if ((all[i]! & 0x80) === 0) break; scale *= 128 }
      replies.push(decodeStage(all.subarray(i + 1, i + 1 + len)))
      o = i + 1 + len
    }
    return { frames, replies }
  }

  it('valid frames in any chunking are handed on whole and in order, with nothing sent back', async () => {
    await fc.assert(fc.asyncProperty(fc.array(fc.constantFrom(...good), { minLength: 1, maxLength: 3 }), chunking, async (fs, chunks) => {
      const r = await feed(Uint8Array.from(fs.flatMap(f => [...encodeStage(f)])), chunks)
      expect(r.frames).toEqual(fs)
      expect(r.replies).toEqual([])
    }), runs('stage links: valid frames, any chunking', 15))
  })

  it('bytes near valid frames and arbitrary bytes: only well-formed frames are handed on, typed error frames come back, never a throw', async () => {
    const seen = { frames: 0, replies: 0 }
    await fc.assert(fc.asyncProperty(fc.oneof(validStage, validStage.chain(near), fc.uint8Array({ minLength: 1, maxLength: 120 })), chunking, async (bytes, chunks) => {
      const r = await feed(bytes, chunks)
      seen.frames += r.frames.length
      seen.replies += r.replies.length
      for (const f of r.frames) stageParts(f) // a frame this node could have sent
      for (const reply of r.replies) {
        expect(reply.kind).toBe('error')
        if (reply.kind === 'error') expect(reply.error.code).toMatch(/^SHOAL_ERR_STAGE_/)
      }
    }), {
      ...runs('stage links: any bytes, any chunking', 30),
      // Random inputs draw a reply in only ~1 run of 10 (a frame whose bounds hold and whose body
      // does not decode), so one such input, followed by a valid frame, always runs as well.
      examples: [[Uint8Array.from([2, 0xff, 0xff, ...encodeStage(good[0]!)]), []]],
    })
    expect(seen.frames).toBeGreaterThan(0)
    expect(seen.replies).toBeGreaterThan(0)
  })
})
