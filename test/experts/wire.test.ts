/**
 * The /shoal/experts/2.0.0 wire format: golden bytes for every frame kind, round trips with
 * tensors viewed in place, and typed errors for malformed frames.
 */
import { describe, expect, it } from 'vitest'
import fc from 'fast-check'
import { decodePayload, encodeFrame, encodePayloadParts, type ExpertFrame, type ExpertGroup } from '../../daemon/experts/index.ts'

const hex = (b: Uint8Array): string => Buffer.from(b).toString('hex')
const payloadOf = (f: ExpertFrame): Uint8Array => {
  const parts = encodePayloadParts(f)
  return Uint8Array.from(parts.flatMap(p => [...p]))
}
const codeOf = (fn: () => unknown): string | undefined => {
  try { fn() } catch (err) { return (err as { code?: string }).code }
  return undefined
}

const compute: ExpertFrame = {
  kind: 'compute', model: 'm1', step: 7, layer: 3, rows: 2, width: 2,
  groups: [{ expert: 1, rows: [0, 1], weights: [0.5, 0.25] }, { expert: 5, rows: [1], weights: [1] }],
  data: Float32Array.from([1, -2, 0.5, 4]),
}

describe('experts wire golden bytes', () => {
  it('compute: header, group table, row indices, weights, rows', () => {
    expect(hex(encodeFrame(compute))).toBe(
      '58' + '02' + '01' + '02' + '6d31' + '000000' + '07000000' +
      '03000000' + '02000000' + '02000000' + '02000000' + '00000000' +
      '01000000' + '02000000' + '05000000' + '01000000' +
      '00000000' + '01000000' + '01000000' +
      '0000003f' + '0000803e' + '0000803f' +
      '0000803f' + '000000c0' + '0000003f' + '00008040')
  })
  it('compute with request spans: span table, ids padded to 4 bytes, then the rows', () => {
    const f: ExpertFrame = { ...compute, spans: [{ id: 'r1', rows: 1 }, { id: 'abc', rows: 1 }] } as ExpertFrame
    expect(hex(payloadOf(f))).toBe(
      '02' + '01' + '02' + '6d31' + '000000' + '07000000' +
      '03000000' + '02000000' + '02000000' + '02000000' + '02000000' +
      '01000000' + '02000000' + '05000000' + '01000000' +
      '00000000' + '01000000' + '01000000' +
      '0000003f' + '0000803e' + '0000803f' +
      '01000000' + '02000000' + '01000000' + '03000000' +
      '7231' + '616263' + '000000' +
      '0000803f' + '000000c0' + '0000003f' + '00008040')
    expect(decodePayload(payloadOf(f))).toEqual(f)
  })
  it('partial', () => {
    expect(hex(encodeFrame({ kind: 'partial', model: 'm1', step: 7, rows: 1, width: 2, data: Float32Array.from([1.5, -1]) })))
      .toBe('1c' + '02' + '02' + '02' + '6d31' + '000000' + '07000000' + '01000000' + '02000000' + '0000c03f' + '000080bf')
  })
  it('error', () => {
    const error = { name: 'ExpertWireError', code: 'SHOAL_ERR_EXPERTS_MALFORMED', message: 'no' }
    expect(hex(payloadOf({ kind: 'error', model: 'abc', step: 0, error }))).toBe('02' + '03' + '03' + '616263' + '0000' + '00000000' + hex(Buffer.from(JSON.stringify(error))))
  })
  it('finish and part', () => {
    expect(hex(payloadOf({ kind: 'finish', model: 'abc', step: 9, requestId: 'r1', sign: true })))
      .toBe('02' + '04' + '03' + '616263' + '0000' + '09000000' + hex(Buffer.from('{"requestId":"r1","sign":true}')))
    expect(hex(payloadOf({ kind: 'part', model: 'abc', step: 9 }))).toBe('02' + '05' + '03' + '616263' + '0000' + '09000000' + hex(Buffer.from('{}')))
    const part = { body: { a: 1 }, signature: 's' }
    expect(hex(payloadOf({ kind: 'part', model: 'abc', step: 9, part }))).toBe('02' + '05' + '03' + '616263' + '0000' + '09000000' + hex(Buffer.from(JSON.stringify({ part }))))
    expect(decodePayload(payloadOf({ kind: 'part', model: 'abc', step: 9, part }))).toEqual({ kind: 'part', model: 'abc', step: 9, part })
    expect(decodePayload(payloadOf({ kind: 'finish', model: 'abc', step: 9, requestId: 'r1', sign: false }))).toEqual({ kind: 'finish', model: 'abc', step: 9, requestId: 'r1', sign: false })
  })
})

describe('experts wire round trips', () => {
  it('decodes what it encodes; tensor data is a view of the frame', () => {
    const p = payloadOf(compute)
    const back = decodePayload(p)
    expect(back).toEqual(compute)
    if (back.kind !== 'compute') throw new Error('kind')
    expect(back.data.buffer).toBe(p.buffer)
  })
  it('decodes a frame inside a pooled Node Buffer at an unaligned offset (copies, never the pool)', () => {
    const p = payloadOf(compute)
    const pool = Buffer.alloc(p.length + 3)
    pool.set(p, 1)
    expect(decodePayload(pool.subarray(1, 1 + p.length))).toEqual(compute)
  })
  it('any valid compute frame survives a round trip', () => {
    fc.assert(fc.property(
      fc.string({ minLength: 1, maxLength: 70 }), fc.integer({ min: 0, max: 2 ** 32 - 1 }), fc.integer({ min: 1, max: 6 }), fc.integer({ min: 1, max: 5 }), fc.integer({ min: 1, max: 8 }), fc.integer(),
      (model, step, rows, width, experts, seed) => {
        let s = seed >>> 0
        const next = (): number => { s = (Math.imul(s, 1664525) + 1013904223) >>> 0; return s / 2 ** 32 }
        const groups = Array.from({ length: experts }, (_, e) => ({ expert: e * 3, rows: [] as number[], weights: [] as number[] }))
        for (let r = 0; r < rows; r++) {
          for (const g of groups) if (next() < 0.4) { g.rows.push(r); g.weights.push(Math.fround(next())) }
          if (!groups.some(g => g.rows.includes(r))) { groups[0]!.rows.push(r); groups[0]!.weights.push(0.5) }
        }
        for (const g of groups) { const order = g.rows.map((r, i) => [r, g.weights[i]!] as const).sort((a, b) => a[0] - b[0]); g.rows = order.map(o => o[0]); g.weights = order.map(o => o[1]) }
        const f: ExpertFrame = { kind: 'compute', model, step, layer: 9, rows, width, groups: groups.filter(g => g.rows.length > 0), data: Float32Array.from({ length: rows * width }, () => Math.fround(next() - 0.5)) }
        expect(decodePayload(payloadOf(f))).toEqual(f)
      }), { numRuns: 100 })
  })
})

describe('experts wire errors', () => {
  it('rejects versions, kinds, truncation, trailing bytes and bad group tables with typed codes', () => {
    const p = payloadOf(compute)
    // Version 1 (no request spans) is refused: a 1.0.0 stage and a 2.0.0 holder never agree on a layout.
    expect(codeOf(() => decodePayload(Uint8Array.from([1, ...p.subarray(1)])))).toBe('SHOAL_ERR_EXPERTS_UNSUPPORTED_VERSION')
    expect(codeOf(() => decodePayload(Uint8Array.from([2, 9, ...p.subarray(2)])))).toBe('SHOAL_ERR_EXPERTS_UNKNOWN_KIND')
    for (const cut of [2, 7, 15, 30, p.length - 1]) expect(codeOf(() => decodePayload(p.subarray(0, cut)))).toBe('SHOAL_ERR_EXPERTS_TRUNCATED')
    expect(codeOf(() => decodePayload(Uint8Array.from([...p, 0, 0, 0, 0])))).toBe('SHOAL_ERR_EXPERTS_MALFORMED')
    const bad = (groups: ExpertGroup[]): string | undefined => codeOf(() => encodeFrame({ ...compute, groups } as ExpertFrame))
    expect(bad([{ expert: 5, rows: [1], weights: [1] }, { expert: 1, rows: [0], weights: [1] }])).toBe('SHOAL_ERR_EXPERTS_MALFORMED') // experts not ascending
    expect(bad([{ expert: 1, rows: [1, 0], weights: [1, 1] }])).toBe('SHOAL_ERR_EXPERTS_MALFORMED') // rows not ascending
    expect(bad([{ expert: 1, rows: [0, 2], weights: [1, 1] }])).toBe('SHOAL_ERR_EXPERTS_MALFORMED') // row out of range
    expect(bad([{ expert: 1, rows: [0], weights: [1] }])).toBe('SHOAL_ERR_EXPERTS_MALFORMED') // row 1 in no group
    expect(bad([{ expert: 1, rows: [0, 1], weights: [1, Number.NaN] }])).toBe('SHOAL_ERR_EXPERTS_MALFORMED')
    // A row index past `rows` written by a peer is caught by the decoder too.
    const forged = p.slice()
    new DataView(forged.buffer).setUint32(48, 9, true)
    expect(codeOf(() => decodePayload(forged))).toBe('SHOAL_ERR_EXPERTS_MALFORMED')
    expect(codeOf(() => encodeFrame(compute, 64))).toBe('SHOAL_ERR_EXPERTS_TOO_LARGE')
  })
  it('rejects request spans that do not cover the rows, empty ids and bad finish bodies', () => {
    const spans = (s: Array<{ id: string, rows: number }>): string | undefined => codeOf(() => encodeFrame({ ...compute, spans: s } as ExpertFrame))
    expect(spans([{ id: 'a', rows: 1 }])).toBe('SHOAL_ERR_EXPERTS_MALFORMED') // 1 of 2 rows
    expect(spans([{ id: 'a', rows: 3 }])).toBe('SHOAL_ERR_EXPERTS_MALFORMED')
    expect(spans([{ id: 'a', rows: 2 }, { id: 'b', rows: 0 }])).toBe('SHOAL_ERR_EXPERTS_MALFORMED')
    expect(spans([{ id: '', rows: 2 }])).toBe('SHOAL_ERR_EXPERTS_MALFORMED')
    expect(spans([{ id: 'x'.repeat(1025), rows: 2 }])).toBe('SHOAL_ERR_EXPERTS_MALFORMED')
    expect(spans([{ id: 'a', rows: 2 }])).toBeUndefined()
    // A peer's span table claiming more rows than the frame has is refused by the decoder.
    const p = payloadOf({ ...compute, spans: [{ id: 'a', rows: 2 }] } as ExpertFrame)
    const forged = p.slice()
    new DataView(forged.buffer).setUint32(72, 3, true) // the span's count
    expect(codeOf(() => decodePayload(forged))).toBe('SHOAL_ERR_EXPERTS_MALFORMED')
    const finish = payloadOf({ kind: 'finish', model: 'abc', step: 1, requestId: 'r', sign: true })
    const body = (json: string): Uint8Array => Uint8Array.from([...finish.subarray(0, 12), ...Buffer.from(json)])
    expect(codeOf(() => decodePayload(body('{"requestId":"r"}')))).toBe('SHOAL_ERR_EXPERTS_MALFORMED')
    expect(codeOf(() => decodePayload(body('{"requestId":"","sign":true}')))).toBe('SHOAL_ERR_EXPERTS_MALFORMED')
    expect(codeOf(() => decodePayload(body('[1]')))).toBe('SHOAL_ERR_EXPERTS_MALFORMED')
  })
})
