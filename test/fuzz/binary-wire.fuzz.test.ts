/**
 * Fuzz of the binary stream protocols between nodes: /shoal/infer/1.0.0 (routing), /shoal/stage/2.0.0
 * (pipeline), /shoal/experts/2.0.0 (MoE experts). For each: (a) any valid frame round-trips;
 * (b) arbitrary bytes, every truncation and every one-byte change of valid frames decode to a frame
 * or throw the protocol's typed error — never a TypeError/RangeError; (c) header fields that claim
 * huge sizes (a length prefix, rows × width, a group count, a token count) are refused from the
 * bytes at hand, before anything that size is allocated.
 */
import fc from 'fast-check'
import * as lp from 'it-length-prefixed'
import { describe, expect, it } from 'vitest'
import { decodeFrames, decodePayload as decodeInfer, encodeFrame as encodeInfer, encodePayload as inferPayload } from '../../daemon/routing/wire.ts'
import type { InferFrame } from '../../daemon/routing/index.ts'
import { decodePayload as decodeStage, encodePayloadParts as stageParts, peekRequestId } from '../../daemon/pipeline/wire.ts'
import type { StageFrame } from '../../daemon/pipeline/index.ts'
import { decodePayload as decodeExperts, encodePayloadParts as expertParts, peekStep } from '../../daemon/experts/wire.ts'
import type { ExpertFrame } from '../../daemon/experts/index.ts'
import { joinParts } from '../../daemon/wire-bytes.ts'
import { anyBytes, expectTyped, near, reportRuns, runs, swept, truncations } from './fuzz.ts'

reportRuns(import.meta.filename)

const INFER = { name: 'InferWireError', code: 'SHOAL_ERR_INFER_' }
const STAGE = { name: 'StageWireError', code: 'SHOAL_ERR_STAGE_' }
const EXPERTS = { name: 'ExpertWireError', code: 'SHOAL_ERR_EXPERTS_' }
const utf8Len = (s: string): number => Buffer.byteLength(s, 'utf8')

// ---- arbitraries of valid values ----

/** Finite doubles as JSON carries them (no -0: JSON writes it as 0). */
const num = fc.double({ noNaN: true, noDefaultInfinity: true }).map(x => x === 0 ? 0 : x)
const str = fc.string({ unit: 'binary', maxLength: 24 })
const id = (maxBytes: number): fc.Arbitrary<string> => fc.string({ unit: 'binary', minLength: 1, maxLength: 24 }).filter(s => utf8Len(s) <= maxBytes)
/** JSON values as they come back from JSON text (fast-check's include -0, which JSON writes as 0). */
const jsonish = fc.jsonValue({ maxDepth: 2 }).map(v => JSON.parse(JSON.stringify(v)) as unknown)
const u32 = fc.nat({ max: 2 ** 32 - 1 })
const tokenIds = fc.array(u32, { maxLength: 12 })

const inferFrame: fc.Arbitrary<InferFrame> = id(256).chain((requestId): fc.Arbitrary<InferFrame> => fc.oneof(
  fc.record({
    model: str,
    prompt: fc.oneof(
      str.map(text => ({ kind: 'text' as const, text })),
      tokenIds.map(ids => ({ kind: 'tokens' as const, ids })),
      fc.array(fc.record({ role: str, content: str, name: str }, { requiredKeys: ['role', 'content'] }), { maxLength: 3 }).map(messages => ({ kind: 'chat' as const, messages })),
    ),
    maxTokens: fc.nat(),
    sampling: fc.record({ temperature: num, topP: num, seed: fc.integer() }, { requiredKeys: ['temperature', 'topP'] }),
    stop: fc.array(str, { maxLength: 3 }),
    deadline: num,
  }, { requiredKeys: ['model', 'prompt', 'sampling', 'stop', 'deadline'] }).map(r => ({ kind: 'request' as const, requestId, request: { requestId, ...r } })),
  fc.record({
    promptTokenIds: tokenIds, route: fc.array(str, { maxLength: 4 }), receiptId: str, manifestHash: str,
    hops: fc.array(fc.record({ peerId: str, layers: fc.tuple(fc.integer(), fc.integer()) }, { requiredKeys: ['peerId'] }), { maxLength: 4 }),
  }, { requiredKeys: ['promptTokenIds', 'route', 'receiptId'] }).map(e => ({ kind: 'start' as const, requestId, event: { type: 'start' as const, ...e } })),
  // Delta text is UTF-8 on the wire: well-formed strings only (a detokenizer emits nothing else).
  fc.record({ text: fc.string({ unit: 'grapheme', maxLength: 24 }), tokenIds }).map(e => ({ kind: 'delta' as const, requestId, event: { type: 'delta' as const, ...e } })),
  fc.record({
    finishReason: fc.constantFrom('stop' as const, 'length' as const),
    usage: fc.record({ promptTokens: fc.nat(), completionTokens: fc.nat() }),
    receiptParts: fc.array(fc.dictionary(fc.string({ maxLength: 6 }), jsonish), { maxLength: 3 }),
  }, { requiredKeys: ['finishReason', 'usage'] }).map(e => ({ kind: 'end' as const, requestId, event: { type: 'end' as const, ...e } })),
  fc.record({ name: str, code: str, message: str, retryAfterMs: fc.double({ min: 0, noNaN: true, noDefaultInfinity: true }).map(x => x === 0 ? 0 : x), param: str }, { requiredKeys: ['name', 'code', 'message'] })
    .map(error => ({ kind: 'error' as const, requestId, error })),
  fc.constant({ kind: 'cancel' as const, requestId }),
))

const f32s = (n: number): fc.Arbitrary<Float32Array> => fc.array(fc.float({ noNaN: true }), { minLength: n, maxLength: n }).map(a => Float32Array.from(a))
const shape = fc.tuple(fc.integer({ min: 1, max: 4 }), fc.integer({ min: 1, max: 5 }))

const stageFrame: fc.Arbitrary<StageFrame> = id(255).chain((requestId): fc.Arbitrary<StageFrame> => fc.oneof(
  fc.record({
    modelId: id(256), manifestHash: id(256), returnTo: id(256),
    chain: fc.array(fc.record({ peerId: id(256), layers: fc.tuple(u32, u32).map(([a, b]) => [Math.min(a, b), Math.max(a, b)] as [number, number]) }), { minLength: 2, maxLength: 5 }),
    sampling: fc.record({ temperature: fc.double({ min: 0, noNaN: true, noDefaultInfinity: true }).map(x => x === 0 ? 0 : x), topP: num, seed: fc.maxSafeInteger() }, { requiredKeys: ['temperature', 'topP'] }),
    rngSkip: u32, deadline: num, receiptId: id(256), hopSeed: fc.nat(),
    // Prefix reuse: fromKey and fromLength come together.
    from: fc.tuple(id(256), fc.integer({ min: 1, max: 2 ** 32 - 1 })),
    // A rebuilt chain: the prefix's token ids, and hop 1 pulling from another peer.
    pulled: fc.tuple(id(256), fc.array(u32, { minLength: 1, maxLength: 5 })),
  }, { requiredKeys: ['modelId', 'manifestHash', 'returnTo', 'chain', 'sampling', 'rngSkip', 'deadline', 'hopSeed'] })
    .map(({ hopSeed, from, pulled, ...o }) => ({
      kind: 'open' as const,
      requestId,
      open: {
        ...o,
        hop: 1 + (hopSeed % (o.chain.length - 1)),
        ...(pulled !== undefined
          ? { fromKey: pulled[0], fromLength: pulled[1].length, pullFrom: [{ hop: 1, peerId: o.chain[1]!.peerId === 'P' ? 'Q' : 'P' }], fromTokens: pulled[1] }
          : from === undefined ? {} : { fromKey: from[0], fromLength: from[1] }),
      },
    })),
  fc.tuple(u32, fc.boolean(), shape).chain(([start, final, [rows, width]]) => f32s(rows * width).map(data => ({ kind: 'activation' as const, requestId, start, final, rows, width, data }))),
  fc.tuple(u32, fc.integer({ min: 1, max: 5 }), fc.integer({ min: 1, max: 4 })).chain(([start, rows, width]) =>
    fc.tuple(f32s(rows * width), fc.array(u32, { minLength: rows - 1, maxLength: rows - 1 }))
      .map(([data, drafts]) => ({ kind: 'activation' as const, requestId, start, final: true, rows, width, data, drafts }))),
  fc.tuple(u32, u32).map(([position, tokenId]) => ({ kind: 'token' as const, requestId, position, tokenId })),
  fc.tuple(u32, u32, u32).map(([position, accepted, tokenId]) => ({ kind: 'verdict' as const, requestId, position, accepted, tokenId })),
  fc.record({ name: str, code: str, message: fc.string({ unit: 'binary', maxLength: 40 }), peerId: id(256) }, { requiredKeys: ['name', 'code', 'message'] }).map(error => ({ kind: 'error' as const, requestId, error })),
  fc.constantFrom('cancel' as const, 'finish' as const).map(kind => ({ kind, requestId })),
  fc.record({ keep: fc.tuple(id(256), fc.integer({ min: 1, max: 2 ** 32 - 1 }), fc.boolean()), evict: fc.array(id(256), { minLength: 1, maxLength: 4 }) }, { requiredKeys: [] })
    .map(({ keep, evict }) => ({ kind: 'finish' as const, requestId, ...(keep === undefined ? {} : { keep: { keep: keep[0], length: keep[1], ...(keep[2] ? { ack: true as const } : {}) } }), ...(evict === undefined ? {} : { evict }) })),
  fc.dictionary(fc.string({ maxLength: 6 }), jsonish).map(part => ({ kind: 'part' as const, requestId, part })),
  fc.tuple(id(256), u32).map(([keep, length]) => ({ kind: 'kept' as const, requestId, keep, length })),
))

const expertFrame: fc.Arbitrary<ExpertFrame> = fc.tuple(id(255), u32).chain(([model, step]): fc.Arbitrary<ExpertFrame> => fc.oneof(
  fc.tuple(u32, shape, fc.integer({ min: 1, max: 4 })).chain(([layer, [rows, width], experts]) => fc.tuple(
    f32s(rows * width),
    // Each row goes to a non-empty subset of experts; every row is in at least one group.
    fc.array(fc.uniqueArray(fc.nat(experts - 1), { minLength: 1, maxLength: experts }), { minLength: rows, maxLength: rows }),
    fc.array(fc.float({ noNaN: true, noDefaultInfinity: true }), { minLength: rows * experts, maxLength: rows * experts }),
  ).map(([data, routes, weights]) => {
    const groups = Array.from({ length: experts }, (_, e) => ({ expert: e * 7, rows: [] as number[], weights: [] as number[] }))
    routes.forEach((es, r) => { for (const e of es) { groups[e]!.rows.push(r); groups[e]!.weights.push(weights[r * experts + e]!) } })
    return { kind: 'compute' as const, model, step, layer, rows, width, groups: groups.filter(g => g.rows.length > 0), data }
  })),
  // Rows attributed to requests: spans covering them in order.
  fc.tuple(fc.integer({ min: 1, max: 4 }), fc.integer({ min: 1, max: 3 }), fc.array(fc.tuple(id(64), fc.integer({ min: 1, max: 3 })), { minLength: 1, maxLength: 3 })).chain(([width, experts, spanSpecs]) => {
    const rows = spanSpecs.reduce((n, [, c]) => n + c, 0)
    return f32s(rows * width).map(data => ({
      kind: 'compute' as const, model, step, layer: 1, rows, width,
      groups: [{ expert: experts, rows: Array.from({ length: rows }, (_, r) => r), weights: new Array<number>(rows).fill(0.5) }],
      spans: spanSpecs.map(([sid, c]) => ({ id: sid, rows: c })), data,
    }))
  }),
  fc.tuple(id(64), fc.boolean()).map(([requestId, sign]) => ({ kind: 'finish' as const, model, step, requestId, sign })),
  fc.option(fc.dictionary(fc.string({ maxLength: 6 }), jsonish), { nil: undefined }).map(part => ({ kind: 'part' as const, model, step, ...(part === undefined ? {} : { part }) })),
  shape.chain(([rows, width]) => f32s(rows * width).map(data => ({ kind: 'partial' as const, model, step, rows, width, data }))),
  fc.record({ name: str, code: str, message: str }).map(error => ({ kind: 'error' as const, model, step, error })),
))

const inferBytes = (f: InferFrame): Uint8Array => inferPayload(f)
const stageBytes = (f: StageFrame): Uint8Array => joinParts(stageParts(f))
const expertBytes = (f: ExpertFrame): Uint8Array => joinParts(expertParts(f))

// Valid encodings to sweep exhaustively (every truncation, every byte position).
const sample = <T>(arb: fc.Arbitrary<T>, n: number, seed: number): T[] => fc.sample(arb, { numRuns: n, seed })

interface Protocol<F> {
  name: string
  typed: { name: string, code: string }
  arb: fc.Arbitrary<F>
  encode: (f: F) => Uint8Array
  decode: (b: Uint8Array) => F
}

const protocols: Array<Protocol<any>> = [
  { name: 'infer', typed: INFER, arb: inferFrame, encode: inferBytes, decode: decodeInfer },
  { name: 'stage', typed: STAGE, arb: stageFrame, encode: stageBytes, decode: decodeStage },
  { name: 'experts', typed: EXPERTS, arb: expertFrame, encode: expertBytes, decode: decodeExperts },
]

for (const p of protocols) {
  describe(`${p.name} frames`, () => {
    it('any valid frame round-trips', () => {
      fc.assert(fc.property(p.arb, (f) => {
        const bytes = p.encode(f)
        expect(p.decode(bytes)).toEqual(f)
        // At an odd offset inside a bigger buffer too (a pooled Node Buffer): views must not be misread.
        const pooled = Buffer.alloc(bytes.length + 3)
        pooled.set(bytes, 1)
        expect(p.decode(pooled.subarray(1, 1 + bytes.length))).toEqual(f)
      }), runs(`${p.name}: round trip`, 100))
    })

    it('arbitrary bytes decode or throw the typed error', () => {
      const typed = (b: Uint8Array): void => {
        const f = expectTyped(() => p.decode(b), p.typed, b)
        // What decodes from hostile bytes is a frame this node could have sent itself.
        if (f !== undefined) p.encode(f)
      }
      fc.assert(fc.property(anyBytes, typed), runs(`${p.name}: arbitrary bytes`, 200))
      // A valid header in front of arbitrary bytes reaches the body decoders, not just the header checks.
      fc.assert(fc.property(p.arb, fc.uint8Array({ maxLength: 64 }), fc.nat(), (f, junk, cut) => {
        const bytes = p.encode(f)
        const head = bytes.subarray(0, Math.min(bytes.length, 4 + (cut % 64)))
        typed(Uint8Array.from([...head, ...junk]))
      }), runs(`${p.name}: valid header, arbitrary body`, 200))
    })

    it('every truncation and any one-byte change of a valid frame decodes or throws the typed error', () => {
      const typed = (b: Uint8Array): void => { expectTyped(() => p.decode(b), p.typed, b) }
      const valid = sample(p.arb, Math.max(3, Math.round(runs(`${p.name}: frames swept`, 3).numRuns!)), 13)
      let inputs = 0
      for (const f of valid) {
        const bytes = p.encode(f)
        for (const t of truncations(bytes)) { typed(t); inputs++ }
        // Every position, with the byte's bits flipped and set to the edges.
        for (let at = 0; at < bytes.length; at++) {
          for (const v of [bytes[at]! ^ 0xff, 0, 0xff, 0x80, bytes[at]! ^ 1]) {
            if (v === bytes[at]) continue
            const copy = bytes.slice()
            copy[at] = v
            typed(copy)
            inputs++
          }
        }
      }
      swept(`${p.name}: every truncation and byte of ${valid.length} frames`, inputs)
      fc.assert(fc.property(p.arb.chain(f => near(p.encode(f))), typed), runs(`${p.name}: near a valid frame`, 150))
    })
  })
}

describe('size claims are refused before allocating', () => {
  it('a length prefix claiming more than the cap is TOO_LARGE without reading on (infer stream decoder)', () => {
    fc.assert(fc.property(fc.integer({ min: 4 * 1024 * 1024 + 1, max: Number.MAX_SAFE_INTEGER }), (claim) => {
      const prefix: number[] = []
      let n = claim
      while (n >= 0x80) { prefix.push((n % 128) | 0x80); n = Math.floor(n / 128) }
      prefix.push(n)
      const err = expectTyped(() => { decodeFrames(Uint8Array.from([...prefix, 1, 6, 1, 0x61])); return 'decoded' }, INFER, claim)
      expect(err).toBeUndefined()
    }), runs('infer: huge length prefix', 200))
    // Nine continuation bytes: it-length-prefixed's own varint bound, mapped to ours.
    expectTyped(() => decodeFrames(Uint8Array.from([0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0x01])), INFER)
    expect(() => decodeFrames(Uint8Array.from(lp.encode.single(new Uint8Array(70)).subarray()), 64)).toThrow(expect.objectContaining({ code: 'SHOAL_ERR_INFER_TOO_LARGE' }))
  })

  it('a delta claiming 2^53 token ids in a few bytes is refused', () => {
    fc.assert(fc.property(fc.integer({ min: 5, max: Number.MAX_SAFE_INTEGER }), fc.uint8Array({ maxLength: 4 }), (count, rest) => {
      const varint: number[] = []
      let n = count
      while (n >= 0x80) { varint.push((n % 128) | 0x80); n = Math.floor(n / 128) }
      varint.push(n)
      expectTyped(() => decodeInfer(Uint8Array.from([1, 3, 1, 0x61, ...varint, ...rest])), INFER)
    }), runs('infer: delta token count claims', 200))
  })

  it('stage activations and expert frames claiming rows × width past their bytes are refused', () => {
    const header = (kind: number, body: number[]): Uint8Array => Uint8Array.from([2, kind, 1, 0x61, ...body])
    const le = (n: number): number[] => [n & 0xff, (n >>> 8) & 0xff, (n >>> 16) & 0xff, (n >>> 24) & 0xff]
    fc.assert(fc.property(u32, u32, u32, fc.constantFrom(0, 1, 2, 3), fc.uint8Array({ maxLength: 32 }), (start, rows, width, flags, tail) => {
      // id "a" → header 4 bytes, body starts at 4: flags, dtype, rank, then no padding (4 + 3 = 7 → 1 byte pad).
      expectTyped(() => decodeStage(header(2, [flags, 1, 2, 0, ...le(start), ...le(rows), ...le(width), ...tail])), STAGE)
    }), runs('stage: activation shape claims', 300))
    fc.assert(fc.property(u32, u32, u32, u32, fc.uint8Array({ maxLength: 64 }), (layer, rows, width, groups, tail) => {
      // model "a": header 3 + 1 → step at 4, body at 8.
      expectTyped(() => decodeExperts(Uint8Array.from([2, 1, 1, 0x61, ...le(0), ...le(layer), ...le(rows), ...le(width), ...le(groups), ...le(groups ^ layer), ...tail])), EXPERTS)
      expectTyped(() => decodeExperts(Uint8Array.from([2, 2, 1, 0x61, ...le(0), ...le(rows), ...le(width), ...tail])), EXPERTS)
    }), runs('experts: shape and group-count claims', 300))
    // A group table whose counts sum past the frame: 2^32 − 1 rows claimed by each of two groups.
    const forged = Uint8Array.from([2, 1, 1, 0x61, ...le(0), ...le(0), ...le(1), ...le(1), ...le(2), ...le(0), ...le(0), ...le(0xffffffff), ...le(1), ...le(0xffffffff)])
    expectTyped(() => decodeExperts(forged), EXPERTS)
    expect(() => decodeExperts(forged)).toThrow()
  })

  it('the peek helpers that name a failing frame never throw', () => {
    fc.assert(fc.property(anyBytes, (b) => {
      const id = peekRequestId(b)
      expect(id === undefined || typeof id === 'string').toBe(true)
      const step = peekStep(b)
      expect(step === undefined || (Number.isInteger(step) && step >= 0)).toBe(true)
    }), runs('stage/experts: peek helpers', 300))
  })

  it('a stream of several frames decodes in order (infer)', () => {
    fc.assert(fc.property(fc.array(inferFrame, { minLength: 1, maxLength: 4 }), (frames) => {
      const bytes = Uint8Array.from(frames.flatMap(f => [...encodeInfer(f)]))
      expect(decodeFrames(bytes)).toEqual(frames)
    }), runs('infer: frame sequences', 100))
  })
})
