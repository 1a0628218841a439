/**
 * The /shoal/kv/1.0.0 wire format: golden bytes for every frame kind, round trips (fast-check),
 * and the puller's receiver: a whole transfer, split at any chunk size, comes back exactly; every
 * truncation and every single-byte change of the stream is refused with a typed error, never
 * accepted as KV.
 */
import fc from 'fast-check'
import { describe, expect, it } from 'vitest'
import {
  createFrameSplitter, createPrefixReceiver, decodePayload, encodeFrame, encodePayloadParts, exactPrefixHashes, prefixScope, transferFrames,
} from '../../daemon/kv/index.ts'
import type { KvFrame, PrefixExpectation, PrefixTransfer, ReceivedPrefix } from '../../daemon/kv/index.ts'

const hex = (b: Uint8Array): string => Buffer.from(b).toString('hex')
const payloadOf = (f: KvFrame): Uint8Array => Uint8Array.from(encodePayloadParts(f).flatMap(p => [...p]))
const codeOf = (fn: () => unknown): string | undefined => {
  try { fn() } catch (err) { return (err as { code?: string }).code }
  return undefined
}

describe('kv wire golden bytes', () => {
  it('pull', () => {
    const f: KvFrame = { kind: 'pull', requestId: 'r1', manifestHash: 'ab', layers: [0, 3], dtype: 'f', blockSize: 2, maxChunkBytes: 64, tokens: [5, 258] }
    expect(hex(encodeFrame(f))).toBe(
      '2a' + '01' + '01' + '02' + '7231' +
      '02' + '6162' + '00000000' + '03000000' + '01' + '66' +
      '02000000' + '40000000' + '02000000' + '05000000' + '02010000' +
      '4ab6ea03')
  })
  it('pull-kept (kind 6, added within version 1): the pull body, then the key and the owner', () => {
    const f: KvFrame = { kind: 'pull-kept', requestId: 'r1', manifestHash: 'ab', layers: [2, 3], dtype: 'f', blockSize: 2, maxChunkBytes: 64, tokens: [5, 258], key: 'k', owner: 'A' }
    const p = payloadOf(f)
    expect(hex(p.subarray(0, p.length - 4))).toBe(
      '01' + '06' + '02' + '7231' +
      '02' + '6162' + '02000000' + '03000000' + '01' + '66' +
      '02000000' + '40000000' + '02000000' + '05000000' + '02010000' +
      '01' + '6b' + '01' + '41')
    expect(decodePayload(p)).toEqual(f)
    // A pull frame is byte for byte what it was.
    const { key: _k, owner: _o, ...rest } = f
    expect(hex(payloadOf({ ...rest, kind: 'pull' }).subarray(0, 35))).toBe('01' + '01' + hex(p.subarray(2, 35)))
    expect(codeOf(() => decodePayload(payloadOf({ ...f, key: '' } as KvFrame)))).toBe('SHOAL_ERR_KV_MALFORMED')
  })
  it('header', () => {
    const f: KvFrame = {
      kind: 'header', requestId: 'r1', manifestHash: 'ab', layers: [2, 2], dtype: 'f', tokens: 3, numKvHeads: 1, headDim: 2, blockSize: 2, chunks: 2,
      hashes: [new Uint8Array(32).fill(0x11), new Uint8Array(32).fill(0x22)],
    }
    expect(hex(encodeFrame(f))).toBe(
      '6e' + '01' + '02' + '02' + '7231' +
      '02' + '6162' + '02000000' + '02000000' + '01' + '66' +
      '03000000' + '01000000' + '02000000' + '02000000' + '02000000' + '02000000' +
      '11'.repeat(32) + '22'.repeat(32) +
      '5a7ba5ed')
  })
  it('chunk: tensor bytes as f32 little-endian', () => {
    const data = Float32Array.from([1, -2])
    const f: KvFrame = { kind: 'chunk', requestId: 'r1', seq: 1, layer: 2, part: 1, offset: 4, data: new Uint8Array(data.buffer) }
    expect(hex(encodeFrame(f))).toBe(
      '22' + '01' + '03' + '02' + '7231' +
      '01000000' + '02000000' + '01' + '04000000' + '02000000' + '0000803f' + '000000c0' +
      'ca10fd9d')
  })
  it('end and error', () => {
    expect(hex(encodeFrame({ kind: 'end', requestId: 'r1', chunks: 9 }))).toBe('0d' + '01' + '04' + '02' + '7231' + '09000000' + '486d0445')
    const error = { name: 'KvRefusedError', code: 'SHOAL_ERR_KV_NOT_HELD', message: 'no' }
    const p = payloadOf({ kind: 'error', requestId: 'r1', error })
    expect(hex(p.subarray(0, p.length - 4))).toBe('01' + '05' + '02' + '7231' + hex(Buffer.from(JSON.stringify(error))))
  })
})

describe('kv wire round trips', () => {
  const str = fc.string({ minLength: 1, maxLength: 40 }).filter(s => Buffer.byteLength(s) <= 255)
  const u32 = fc.integer({ min: 0, max: 2 ** 32 - 1 })
  const layers = fc.tuple(fc.integer({ min: 0, max: 100 }), fc.integer({ min: 0, max: 100 })).map(([a, b]) => [Math.min(a, b), Math.max(a, b)] as const)
  const frame: fc.Arbitrary<KvFrame> = fc.oneof(
    fc.record({ kind: fc.constant('pull' as const), requestId: str, manifestHash: str, layers, dtype: str, blockSize: fc.integer({ min: 1, max: 1024 }), maxChunkBytes: u32, tokens: fc.array(u32, { maxLength: 50 }) }),
    fc.record({ kind: fc.constant('pull-kept' as const), requestId: str, manifestHash: str, layers, dtype: str, blockSize: fc.integer({ min: 1, max: 1024 }), maxChunkBytes: u32, tokens: fc.array(u32, { maxLength: 50 }), key: str, owner: str }),
    fc.record({
      kind: fc.constant('header' as const), requestId: str, manifestHash: str, layers, dtype: str, tokens: u32, numKvHeads: u32, headDim: u32,
      blockSize: fc.integer({ min: 1, max: 1024 }), chunks: u32, hashes: fc.array(fc.uint8Array({ minLength: 32, maxLength: 32 }), { maxLength: 5 }),
    }),
    fc.record({
      kind: fc.constant('chunk' as const), requestId: str, seq: u32, layer: u32, part: fc.constantFrom(0 as const, 1 as const), offset: u32,
      data: fc.array(fc.float({ noNaN: true }), { minLength: 1, maxLength: 20 }).map(v => new Uint8Array(Float32Array.from(v).buffer)),
    }),
    fc.record({ kind: fc.constant('end' as const), requestId: str, chunks: u32 }),
    fc.record({ kind: fc.constant('error' as const), requestId: str, error: fc.record({ name: str, code: str, message: fc.string({ maxLength: 100 }) }) }),
  )

  it('decodes what it encodes', () => {
    fc.assert(fc.property(frame, (f) => {
      const back = decodePayload(payloadOf(f))
      if (f.kind === 'chunk' && back.kind === 'chunk') expect(hex(back.data)).toBe(hex(f.data))
      expect({ ...back, ...(back.kind === 'chunk' ? { data: null } : {}) }).toEqual({ ...f, ...(f.kind === 'chunk' ? { data: null } : {}) })
    }))
  })

  it('refuses every truncated payload and every single-byte change with a typed error', () => {
    fc.assert(fc.property(frame, fc.nat(), fc.integer({ min: 1, max: 255 }), (f, at, flip) => {
      const p = payloadOf(f)
      const cut = at % p.length
      expect(codeOf(() => decodePayload(p.subarray(0, cut)))).toMatch(/^SHOAL_ERR_KV_/)
      const bad = p.slice()
      bad[cut] = bad[cut]! ^ flip
      expect(codeOf(() => decodePayload(bad))).toMatch(/^SHOAL_ERR_KV_/)
    }))
  })

  it('refuses a frame over the cap before buffering it, and an over-long length prefix', () => {
    const split = createFrameSplitter(100)
    expect(codeOf(() => split.push(Uint8Array.of(0xe5, 0x00)))).toBe('SHOAL_ERR_KV_TOO_LARGE')
    expect(codeOf(() => createFrameSplitter().push(Uint8Array.of(0x80, 0x80, 0x80, 0x80, 0x80, 0x01)))).toBe('SHOAL_ERR_KV_TOO_LARGE')
    expect(codeOf(() => encodeFrame({ kind: 'pull', requestId: 'r', manifestHash: 'm', layers: [0, 0], dtype: 'f', blockSize: 1, maxChunkBytes: 1, tokens: new Array(40).fill(1) }, 100))).toBe('SHOAL_ERR_KV_TOO_LARGE')
  })

  it('names a wrong version before anything else', () => {
    const p = payloadOf({ kind: 'end', requestId: 'r', chunks: 1 })
    p[0] = 2
    expect(codeOf(() => decodePayload(p))).toBe('SHOAL_ERR_KV_UNSUPPORTED_VERSION')
  })
})

// ---- whole transfers through the receiver ----

const SCOPE = { manifestHash: 'sha256-of-manifest', layers: [4, 6] as const, dtype: 'float32' }
const KVH = 2
const HD = 3
const BLOCK = 4

/** A transfer of the first `n` of `tokens`, with deterministic tensor values, split into chunks of `chunkBytes`. */
function transfer (tokens: number[], n: number, chunkBytes: number, requestId = 'req'): { frames: KvFrame[], tensors: Float32Array[] } {
  const size = KVH * n * HD
  const tensors = Array.from({ length: 6 }, (_, i) => Float32Array.from({ length: size }, (_, j) => Math.sin(i * 1000 + j)))
  const scope = prefixScope({ ...SCOPE, layers: [4, 6] })
  const t: PrefixTransfer = {
    requestId, ...SCOPE, tokens: n, numKvHeads: KVH, headDim: HD, blockSize: BLOCK,
    hashes: exactPrefixHashes(scope, tokens.slice(0, n), BLOCK), tensors, maxChunkBytes: chunkBytes,
  }
  return { frames: [...transferFrames(t)], tensors }
}

const expectation = (tokens: number[], chunkBytes: number, requestId = 'req'): PrefixExpectation =>
  ({ requestId, ...SCOPE, numKvHeads: KVH, headDim: HD, blockSize: BLOCK, tokens, maxChunkBytes: chunkBytes })

/** Feeds a byte stream, in pieces of `piece` bytes, through splitter, decoder and receiver. */
function receive (bytes: Uint8Array, x: PrefixExpectation, piece = 7): ReceivedPrefix {
  const split = createFrameSplitter()
  const rx = createPrefixReceiver(x)
  for (let at = 0; at < bytes.length; at += piece) {
    for (const p of split.push(bytes.subarray(at, at + piece))) rx.accept(decodePayload(p))
  }
  return rx.finish()
}

const streamOf = (frames: KvFrame[]): Uint8Array => Uint8Array.from(frames.flatMap(f => [...encodeFrame(f)]))

describe('a prefix transfer through the receiver', () => {
  const tokens = Array.from({ length: 13 }, (_, i) => 100 + i * 7)

  it('returns exactly the tensors sent, at any chunk size and any read size', () => {
    fc.assert(fc.property(fc.integer({ min: 1, max: 13 }), fc.integer({ min: 1, max: 64 }), fc.integer({ min: 1, max: 50 }), (n, values, piece) => {
      const { frames, tensors } = transfer(tokens, n, values * 4)
      const got = receive(streamOf(frames), expectation(tokens, values * 4), piece)
      expect(got.tokens).toBe(n)
      expect(got.tensors).toEqual(tensors)
      expect(got.bytes).toBe(6 * KVH * n * HD * 4)
    }))
  })

  it('refuses every truncation of the stream (SHOAL_ERR_KV_TRUNCATED or a typed error)', () => {
    const bytes = streamOf(transfer(tokens, 11, 40).frames)
    for (let cut = 0; cut < bytes.length; cut++) {
      expect(codeOf(() => receive(bytes.subarray(0, cut), expectation(tokens, 40)))).toMatch(/^SHOAL_ERR_KV_/)
    }
  })

  it('refuses every single-byte change anywhere in the stream', () => {
    const bytes = streamOf(transfer(tokens, 9, 24).frames)
    fc.assert(fc.property(fc.integer({ min: 0, max: bytes.length - 1 }), fc.integer({ min: 1, max: 255 }), (at, flip) => {
      const bad = bytes.slice()
      bad[at] = bad[at]! ^ flip
      expect(codeOf(() => receive(bad, expectation(tokens, 24)))).toMatch(/^SHOAL_ERR_KV_/)
    }), { numRuns: 2000 })
  })

  it('refuses frames that are well formed but wrong: other tokens, scope, shapes, order, counts', () => {
    const x = expectation(tokens, 40)
    const codeFor = (frames: KvFrame[], exp = x): string | undefined => codeOf(() => receive(streamOf(frames), exp))
    const good = transfer(tokens, 12, 40).frames
    const header = good[0] as Extract<KvFrame, { kind: 'header' }>
    // The holder's KV is of other tokens: its hashes are not these tokens'.
    const other = transfer([...tokens.slice(0, 10), 1, 2, 3], 12, 40).frames
    expect(codeFor(other)).toBe('SHOAL_ERR_KV_MISMATCH')
    expect(codeFor([{ ...header, manifestHash: 'another' }, ...good.slice(1)])).toBe('SHOAL_ERR_KV_MISMATCH')
    expect(codeFor([{ ...header, layers: [4, 5] }, ...good.slice(1)])).toBe('SHOAL_ERR_KV_MISMATCH')
    expect(codeFor([{ ...header, numKvHeads: 1 }, ...good.slice(1)])).toBe('SHOAL_ERR_KV_MISMATCH')
    expect(codeFor([{ ...header, tokens: 14 }, ...good.slice(1)])).toBe('SHOAL_ERR_KV_MISMATCH')
    // Chunks swapped, one missing, one repeated; the end frame's count wrong; a chunk too large.
    expect(codeFor([good[0]!, good[2]!, good[1]!, ...good.slice(3)])).toBe('SHOAL_ERR_KV_UNEXPECTED_FRAME')
    expect(codeFor([good[0]!, ...good.slice(2)])).toBe('SHOAL_ERR_KV_UNEXPECTED_FRAME')
    expect(codeFor([good[0]!, good[1]!, ...good.slice(1)])).toBe('SHOAL_ERR_KV_UNEXPECTED_FRAME')
    expect(codeFor([...good.slice(0, -1), { kind: 'end', requestId: 'req', chunks: header.chunks + 1 }])).toBe('SHOAL_ERR_KV_MISMATCH')
    expect(codeFor([...good.slice(0, -2), good[good.length - 1]!])).toBe('SHOAL_ERR_KV_TRUNCATED')
    expect(codeFor(transfer(tokens, 12, 80).frames)).toBe('SHOAL_ERR_KV_TOO_LARGE')
    // Another request's frames; frames after the end.
    expect(codeFor(transfer(tokens, 12, 40, 'other').frames)).toBe('SHOAL_ERR_KV_UNEXPECTED_FRAME')
    expect(codeFor([...good, good[good.length - 1]!])).toBe('SHOAL_ERR_KV_UNEXPECTED_FRAME')
    // The holder's refusal arrives as its own typed code.
    expect(codeFor([{ kind: 'error', requestId: 'req', error: { name: 'KvRefusedError', code: 'SHOAL_ERR_KV_NOT_HELD', message: 'none' } }])).toBe('SHOAL_ERR_KV_NOT_HELD')
  })
})
