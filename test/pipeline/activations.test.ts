/**
 * Compressed activations on the stage wire (f16, int8 with a per-row scale): golden bytes of both
 * frame forms and of an open frame asking for them, error bounds of the round trip, f16 rounding
 * against the runtime's own Float16Array, and typed refusals (non-finite int8 rows, bad scales,
 * unknown encodings in an open frame). f32 frames are untouched (wire.test.ts pins them).
 */
import { describe, expect, it } from 'vitest'
import { chainEncoding, decodePayload, encodeFrame, encodePayloadParts, roundTripActivation, toF16Bits } from '../../daemon/pipeline/index.ts'
import type { OpenBody, StageFrame } from '../../daemon/pipeline/index.ts'
import { Prng } from '../../shards/testmodel/prng.ts'

const hex = (b: Uint8Array): string => Buffer.from(b).toString('hex')
const payloadOf = (f: StageFrame): Uint8Array => Uint8Array.from(encodePayloadParts(f).flatMap(p => [...p]))
type Activation = Extract<StageFrame, { kind: 'activation' }>

describe('compressed activation frames: golden bytes', () => {
  it('pins the f16 frame (dtype 2, two bytes a value)', () => {
    const f: StageFrame = { kind: 'activation', requestId: 'ab', start: 7, final: true, rows: 1, width: 2, data: Float32Array.of(1, -2), encoding: 'f16' }
    expect(hex(encodeFrame(f))).toBe('18' + '02' + '02' + '02' + '6162' + '01' + '02' + '02' + '07000000' + '01000000' + '02000000' + '003c' + '00c0')
    expect(decodePayload(payloadOf(f))).toEqual(f)
  })

  it('pins the int8 frame (dtype 3: the rows\' f32 scales, then int8 values, half away from zero)', () => {
    const f: StageFrame = { kind: 'activation', requestId: 'ab', start: 0, final: false, rows: 2, width: 2, data: Float32Array.of(127, -3.5, 63.5, 1), encoding: 'int8' }
    expect(hex(encodeFrame(f))).toBe('20' + '02' + '02' + '02' + '6162' + '00' + '03' + '02' + '00000000' + '02000000' + '02000000' + '0000803f' + '0000003f' + '7ffc' + '7f02')
    const back = decodePayload(payloadOf(f)) as Activation
    expect(back.encoding).toBe('int8')
    expect([...back.data]).toEqual([127, -4, 63.5, 1])
  })

  it('pins a verify frame in f16 (drafts before the tensor as in f32)', () => {
    const f: StageFrame = { kind: 'activation', requestId: 'ab', start: 7, final: true, rows: 2, width: 1, data: Float32Array.of(0.5, 65504), drafts: [300], encoding: 'f16' }
    expect(hex(encodeFrame(f))).toBe('20' + '02' + '02' + '02' + '6162' + '03' + '02' + '02' + '07000000' + '02000000' + '01000000' + '01000000' + '2c010000' + '0038' + 'ff7b')
    expect(decodePayload(payloadOf(f))).toEqual(f)
  })

  it('pins the open frame asking for a lossy encoding (the key last; absent means f32)', () => {
    const open: OpenBody = { modelId: 'm', manifestHash: 'ab', chain: [{ peerId: 'A', layers: [0, 1] }, { peerId: 'B', layers: [2, 3] }], hop: 1, returnTo: 'A', sampling: { temperature: 0, topP: 1 }, rngSkip: 0, deadline: 5, activations: 'int8' }
    const body = '{"modelId":"m","manifestHash":"ab","chain":[{"peerId":"A","layers":[0,1]},{"peerId":"B","layers":[2,3]}],"hop":1,"returnTo":"A","sampling":{"temperature":0,"topP":1},"rngSkip":0,"deadline":5,"activations":"int8"}'
    expect(hex(payloadOf({ kind: 'open', requestId: 'x', open }))).toBe('02' + '01' + '01' + '78' + hex(Buffer.from(body)))
    expect(decodePayload(payloadOf({ kind: 'open', requestId: 'x', open }))).toEqual({ kind: 'open', requestId: 'x', open })
    const bad = Buffer.from(body.replace('"int8"', '"bf16"'))
    expect(() => decodePayload(Uint8Array.of(2, 1, 1, 0x78, ...bad))).toThrow(expect.objectContaining({ code: 'SHOAL_ERR_STAGE_MALFORMED' }))
  })
})

describe('compressed activations: round-trip error', () => {
  const rng = new Prng(7)
  const rows = 16
  const width = 512
  // Hidden-state-like rows: mostly N(0, σ) with σ from 1e-3 to 1e2, a few outlier dimensions.
  const data = new Float32Array(rows * width)
  for (let r = 0; r < rows; r++) {
    const sigma = 10 ** (-3 + 5 * r / (rows - 1))
    for (let i = 0; i < width; i++) data[r * width + i] = rng.normal() * sigma * (i % 97 === 0 ? 30 : 1)
  }

  it('f16: relative error ≤ 2^-11 in the normal range, absolute ≤ 2^-25 below it; matches Float16Array', () => {
    const back = roundTripActivation('f16', data, rows, width)
    const F16 = (globalThis as { Float16Array?: new (a: ArrayLike<number>) => ArrayLike<number> }).Float16Array
    const native = F16 === undefined ? undefined : new F16(data)
    for (let i = 0; i < data.length; i++) {
      const x = data[i]!
      const err = Math.abs(back[i]! - x)
      if (Math.abs(x) >= 2 ** -14) expect(err).toBeLessThanOrEqual(Math.abs(x) * 2 ** -11)
      else expect(err).toBeLessThanOrEqual(2 ** -25)
      if (native !== undefined) expect(back[i]).toBe(native[i])
    }
  })

  it('f16 decodes the same at any byte offset (aligned view or DataView)', () => {
    const f: StageFrame = { kind: 'activation', requestId: 'ab', start: 0, final: true, rows: 2, width: 3, data: Float32Array.of(1, -2, 0.5, 3.25, -0.125, 7), encoding: 'f16' }
    const payload = payloadOf(f)
    for (const shift of [0, 1, 2, 3]) {
      const at = new Uint8Array(new ArrayBuffer(payload.length + 8), shift, payload.length)
      at.set(payload)
      expect([...(decodePayload(at) as Activation).data]).toEqual([1, -2, 0.5, 3.25, -0.125, 7])
    }
  })

  it('f16 saturates at ±65504 instead of overflowing to ±∞, and rounds ties to even', () => {
    expect([...roundTripActivation('f16', Float32Array.of(1e6, -70000, 65519, 65520), 1, 4)]).toEqual([65504, -65504, 65504, 65504])
    expect(toF16Bits(1 + 2 ** -11)).toBe(0x3c00) // tie: to the even mantissa
    expect(toF16Bits(1 + 3 * 2 ** -11)).toBe(0x3c02)
    expect(toF16Bits(2 ** -24)).toBe(1)
    expect(toF16Bits(2 ** -25)).toBe(0) // tie at the bottom: to even (zero)
    expect(Number.isNaN(roundTripActivation('f16', Float32Array.of(NaN), 1, 1)[0])).toBe(true)
  })

  it('int8: error ≤ half a step of the row\'s scale (max|x| / 127), zero rows exact', () => {
    const withZero = Float32Array.from([...data, ...new Float32Array(width)])
    const back = roundTripActivation('int8', withZero, rows + 1, width)
    for (let r = 0; r <= rows; r++) {
      let max = 0
      for (let i = 0; i < width; i++) max = Math.max(max, Math.abs(withZero[r * width + i]!))
      const step = Math.fround(max / 127)
      for (let i = 0; i < width; i++) {
        const k = r * width + i
        expect(Math.abs(back[k]! - withZero[k]!)).toBeLessThanOrEqual(step / 2 * (1 + 1e-6))
      }
    }
    expect([...back.subarray(rows * width)].every(v => v === 0)).toBe(true)
  })

  it('int8 refuses a row with a non-finite value, and a frame whose scale is not finite', () => {
    expect(() => encodeFrame({ kind: 'activation', requestId: 'a', start: 0, final: true, rows: 1, width: 2, data: Float32Array.of(1, Infinity), encoding: 'int8' }))
      .toThrow(expect.objectContaining({ code: 'SHOAL_ERR_STAGE_MALFORMED' }))
    const ok = payloadOf({ kind: 'activation', requestId: 'ab', start: 0, final: true, rows: 1, width: 2, data: Float32Array.of(1, 2), encoding: 'int8' })
    const bad = ok.slice()
    bad.set([0, 0, 0xc0, 0x7f], ok.length - 6) // the scale becomes NaN
    expect(() => decodePayload(bad)).toThrow(expect.objectContaining({ code: 'SHOAL_ERR_STAGE_MALFORMED' }))
    expect(() => decodePayload(ok.subarray(0, ok.length - 1))).toThrow(expect.objectContaining({ code: 'SHOAL_ERR_STAGE_TRUNCATED' }))
  })
})

describe('the encoding a chain is opened with', () => {
  const accepts = (table: Record<string, string[]>) => (peerId: string): string[] | undefined => table[peerId]
  it('is the requested one only when every later stage declares it, else f32', () => {
    expect(chainEncoding('f16', ['b', 'c'], accepts({ b: ['f16', 'int8'], c: ['f16'] }))).toBe('f16')
    expect(chainEncoding('int8', ['b', 'c'], accepts({ b: ['f16', 'int8'], c: ['f16'] }))).toBe('f32')
    expect(chainEncoding('f16', ['b', 'c'], accepts({ b: ['f16'] }))).toBe('f32') // c declared nothing
    expect(chainEncoding('f32', ['b'], accepts({ b: ['f16'] }))).toBe('f32')
  })
})
