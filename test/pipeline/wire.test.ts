/**
 * The /shoal/stage/2.0.0 wire format: golden bytes for every frame kind, round trips, zero-copy
 * tensor views, and typed refusals of truncated, oversized, wrong-version and malformed frames.
 */
import { describe, expect, it } from 'vitest'
import { decodePayload, encodeFrame, encodePayloadParts, MAX_FRAME_BYTES, STAGE_WIRE_VERSION } from '../../daemon/pipeline/index.ts'
import type { OpenBody, StageFrame } from '../../daemon/pipeline/index.ts'

const hex = (b: Uint8Array): string => Buffer.from(b).toString('hex')
const payloadOf = (f: StageFrame): Uint8Array => {
  const parts = encodePayloadParts(f)
  return Uint8Array.from(parts.flatMap(p => [...p]))
}

const open: OpenBody = {
  modelId: 'm',
  manifestHash: 'ab',
  chain: [{ peerId: 'A', layers: [0, 1] }, { peerId: 'B', layers: [2, 3] }],
  hop: 1,
  returnTo: 'A',
  sampling: { temperature: 0, topP: 1 },
  rngSkip: 0,
  deadline: 5,
}

describe('stage wire golden bytes', () => {
  it('pins the token frame', () => {
    expect(hex(encodeFrame({ kind: 'token', requestId: 'r1', position: 5, tokenId: 300 }))).toBe('0d' + '02' + '03' + '02' + '7231' + '05000000' + '2c010000')
  })
  it('pins the cancel frame', () => {
    expect(hex(encodeFrame({ kind: 'cancel', requestId: 'r1' }))).toBe('05' + '02' + '05' + '02' + '7231')
  })
  it('pins the finish and part frames', () => {
    expect(hex(encodeFrame({ kind: 'finish', requestId: 'r1' }))).toBe('05' + '02' + '06' + '02' + '7231')
    const part = '{"body":{"peerId":"B"},"signature":"s"}'
    expect(hex(payloadOf({ kind: 'part', requestId: 'x', part: { body: { peerId: 'B' }, signature: 's' } }))).toBe('02' + '07' + '01' + '78' + hex(Buffer.from(part)))
  })
  it('pins the activation frame (no padding needed)', () => {
    const f: StageFrame = { kind: 'activation', requestId: 'ab', start: 7, final: true, rows: 1, width: 2, data: Float32Array.of(1, -2) }
    expect(hex(encodeFrame(f))).toBe('1c' + '02' + '02' + '02' + '6162' + '01' + '01' + '02' + '07000000' + '01000000' + '02000000' + '0000803f' + '000000c0')
  })
  it('pins the activation frame (padded so tensor bytes are 4-byte aligned)', () => {
    const f: StageFrame = { kind: 'activation', requestId: 'abc', start: 0, final: false, rows: 1, width: 1, data: Float32Array.of(0.5) }
    expect(hex(encodeFrame(f))).toBe('1c' + '02' + '02' + '03' + '616263' + '00' + '01' + '02' + '000000' + '00000000' + '01000000' + '01000000' + '0000003f')
  })
  it('pins the verify activation frame (version 2: drafts before the tensor, still aligned) and the verdict frame', () => {
    const f: StageFrame = { kind: 'activation', requestId: 'ab', start: 7, final: true, rows: 3, width: 1, data: Float32Array.of(1, -2, 0.5), drafts: [300, 5] }
    expect(hex(encodeFrame(f))).toBe('2c' + '02' + '02' + '02' + '6162' + '03' + '01' + '02' + '07000000' + '03000000' + '01000000' + '02000000' + '2c010000' + '05000000' + '0000803f' + '000000c0' + '0000003f')
    const back = decodePayload(payloadOf(f))
    expect(back).toMatchObject({ kind: 'activation', start: 7, final: true, rows: 3, width: 1, drafts: [300, 5] })
    expect([...(back as Extract<StageFrame, { kind: 'activation' }>).data]).toEqual([1, -2, 0.5])
    expect(hex(encodeFrame({ kind: 'verdict', requestId: 'r1', position: 9, accepted: 1, tokenId: 300 }))).toBe('11' + '02' + '08' + '02' + '7231' + '09000000' + '01000000' + '2c010000')
    expect(decodePayload(payloadOf({ kind: 'verdict', requestId: 'r1', position: 9, accepted: 1, tokenId: 300 }))).toEqual({ kind: 'verdict', requestId: 'r1', position: 9, accepted: 1, tokenId: 300 })
  })
  it('refuses a verify that is not final or whose drafts do not match its rows', () => {
    const base = { kind: 'activation' as const, requestId: 'ab', start: 0, rows: 2, width: 1, data: Float32Array.of(1, 2) }
    expect(() => encodeFrame({ ...base, final: false, drafts: [1] })).toThrow(expect.objectContaining({ code: 'SHOAL_ERR_STAGE_MALFORMED' }))
    expect(() => encodeFrame({ ...base, final: true, drafts: [1, 2] })).toThrow(expect.objectContaining({ code: 'SHOAL_ERR_STAGE_MALFORMED' }))
    const ok = payloadOf({ ...base, final: true, drafts: [1] })
    const notFinal = ok.slice()
    notFinal[5] = 2 // verify without final
    expect(() => decodePayload(notFinal)).toThrow(expect.objectContaining({ code: 'SHOAL_ERR_STAGE_MALFORMED' }))
    const tooMany = ok.slice()
    tooMany[20] = 3 // k = 3 drafts for 2 rows
    expect(() => decodePayload(tooMany)).toThrow(expect.objectContaining({ code: 'SHOAL_ERR_STAGE_MALFORMED' }))
  })
  it('pins the error and open frames (JSON with a fixed key order)', () => {
    const err = '{"name":"StageWireError","code":"SHOAL_ERR_STAGE_UNKNOWN_REQUEST","message":"no","peerId":"B"}'
    expect(hex(payloadOf({ kind: 'error', requestId: 'x', error: { name: 'StageWireError', code: 'SHOAL_ERR_STAGE_UNKNOWN_REQUEST', message: 'no', peerId: 'B' } })))
      .toBe('02' + '04' + '01' + '78' + hex(Buffer.from(err)))
    const body = '{"modelId":"m","manifestHash":"ab","chain":[{"peerId":"A","layers":[0,1]},{"peerId":"B","layers":[2,3]}],"hop":1,"returnTo":"A","sampling":{"temperature":0,"topP":1},"rngSkip":0,"deadline":5}'
    expect(hex(payloadOf({ kind: 'open', requestId: 'x', open }))).toBe('02' + '01' + '01' + '78' + hex(Buffer.from(body)))
  })
  it('pins the prefix-reuse fields (version 2, optional: frames without them are unchanged): open fromKey + fromLength, finish with keep', () => {
    const body = '{"modelId":"m","manifestHash":"ab","chain":[{"peerId":"A","layers":[0,1]},{"peerId":"B","layers":[2,3]}],"hop":1,"returnTo":"A","sampling":{"temperature":0,"topP":1},"rngSkip":0,"deadline":5,"fromKey":"k1","fromLength":38}'
    const withFrom: StageFrame = { kind: 'open', requestId: 'x', open: { ...open, fromKey: 'k1', fromLength: 38 } }
    expect(hex(payloadOf(withFrom))).toBe('02' + '01' + '01' + '78' + hex(Buffer.from(body)))
    expect(decodePayload(payloadOf(withFrom))).toEqual(withFrom)
    const keep: StageFrame = { kind: 'finish', requestId: 'r1', keep: { keep: 'k1', length: 40 } }
    expect(hex(payloadOf(keep))).toBe('02' + '06' + '02' + '7231' + hex(Buffer.from('{"keep":"k1","length":40}')))
    expect(decodePayload(payloadOf(keep))).toEqual(keep)
    const both: StageFrame = { kind: 'finish', requestId: 'r1', keep: { keep: 'k2', length: 9 }, evict: ['k1', 'k0'] }
    expect(hex(payloadOf(both))).toBe('02' + '06' + '02' + '7231' + hex(Buffer.from('{"keep":"k2","length":9,"evict":["k1","k0"]}')))
    expect(decodePayload(payloadOf(both))).toEqual(both)
    const acked: StageFrame = { kind: 'finish', requestId: 'r1', keep: { keep: 'k2', length: 9, ack: true }, evict: ['k1'] }
    expect(hex(payloadOf(acked))).toBe('02' + '06' + '02' + '7231' + hex(Buffer.from('{"keep":"k2","length":9,"evict":["k1"],"ack":true}')))
    expect(decodePayload(payloadOf(acked))).toEqual(acked)
    const evictOnly: StageFrame = { kind: 'finish', requestId: 'r1', evict: ['k1'] }
    expect(hex(payloadOf(evictOnly))).toBe('02' + '06' + '02' + '7231' + hex(Buffer.from('{"evict":["k1"]}')))
    expect(decodePayload(payloadOf(evictOnly))).toEqual(evictOnly)
  })
  it('pins the kept frame (version 2, kind 9: a stage\'s answer to a finish with keep and ack)', () => {
    const kept: StageFrame = { kind: 'kept', requestId: 'r1', keep: 'k2', length: 9 }
    expect(hex(encodeFrame(kept))).toBe('1d' + '02' + '09' + '02' + '7231' + hex(Buffer.from('{"keep":"k2","length":9}')))
    expect(decodePayload(payloadOf(kept))).toEqual(kept)
    expect(decodePayload(payloadOf({ ...kept, length: 0 }))).toEqual({ ...kept, length: 0 })
    // An ack without keep, or not true; a kept frame without its key.
    expect(() => decodePayload(Uint8Array.of(2, 6, 1, 0x78, ...Buffer.from('{"evict":["k1"],"ack":true}')))).toThrow(expect.objectContaining({ code: 'SHOAL_ERR_STAGE_MALFORMED' }))
    expect(() => decodePayload(Uint8Array.of(2, 6, 1, 0x78, ...Buffer.from('{"keep":"k","length":1,"ack":1}')))).toThrow(expect.objectContaining({ code: 'SHOAL_ERR_STAGE_MALFORMED' }))
    expect(() => decodePayload(Uint8Array.of(2, 9, 1, 0x78, ...Buffer.from('{"length":1}')))).toThrow(expect.objectContaining({ code: 'SHOAL_ERR_STAGE_MALFORMED' }))
  })
  it('pins the rebuilt-chain fields (version 2, optional: frames without them are unchanged): open pullFrom + fromTokens', () => {
    const body = '{"modelId":"m","manifestHash":"ab","chain":[{"peerId":"A","layers":[0,1]},{"peerId":"B","layers":[2,3]}],"hop":1,"returnTo":"A","sampling":{"temperature":0,"topP":1},"rngSkip":0,"deadline":5,"fromKey":"k1","fromLength":3,"pullFrom":[{"hop":1,"peerId":"C"}],"fromTokens":[7,8,9]}'
    const pulled: StageFrame = { kind: 'open', requestId: 'x', open: { ...open, fromKey: 'k1', fromLength: 3, pullFrom: [{ hop: 1, peerId: 'C' }], fromTokens: [7, 8, 9] } }
    expect(hex(payloadOf(pulled))).toBe('02' + '01' + '01' + '78' + hex(Buffer.from(body)))
    expect(decodePayload(payloadOf(pulled))).toEqual(pulled)
  })
})

describe('stage wire decoding', () => {
  it('refuses a finish with a body and a part that is not an object', () => {
    const finish = payloadOf({ kind: 'finish', requestId: 'x' })
    expect(() => decodePayload(Uint8Array.of(...finish, 0x01))).toThrowError(expect.objectContaining({ code: 'SHOAL_ERR_STAGE_MALFORMED' }))
    const notObject = Uint8Array.of(2, 7, 1, 0x78, ...Buffer.from('[1,2]'))
    expect(() => decodePayload(notObject)).toThrowError(expect.objectContaining({ code: 'SHOAL_ERR_STAGE_MALFORMED' }))
  })


  it('round-trips every kind', () => {
    const frames: StageFrame[] = [
      { kind: 'open', requestId: 'req-1', open: { ...open, sampling: { temperature: 0.7, topP: 0.9, seed: 42 }, rngSkip: 3 } },
      { kind: 'activation', requestId: 'req-1', start: 12, final: false, rows: 3, width: 4, data: Float32Array.from({ length: 12 }, (_, i) => i / 7) },
      { kind: 'token', requestId: 'req-1', position: 15, tokenId: 31999 },
      { kind: 'error', requestId: '', error: { name: 'E', code: 'SHOAL_ERR_X', message: 'm' } },
      { kind: 'cancel', requestId: 'req-1' },
      { kind: 'finish', requestId: 'req-1' },
      { kind: 'part', requestId: 'req-1', part: { body: { peerId: 'B', layers: [2, 3] }, signature: 'sig' } },
      { kind: 'open', requestId: 'req-1~r1', open: { ...open, receiptId: 'req-1' } },
    ]
    for (const f of frames) {
      const bytes = encodeFrame(f)
      expect(decodePayload(bytes.subarray(bytes[0]! < 0x80 ? 1 : 2))).toEqual(f)
    }
  })

  it('views tensor bytes in place when aligned, copies otherwise', () => {
    const f: StageFrame = { kind: 'activation', requestId: 'ab', start: 0, final: true, rows: 2, width: 2, data: Float32Array.of(1, 2, 3, 4) }
    const payload = payloadOf(f)
    const aligned = new Uint8Array(new ArrayBuffer(payload.length + 8), 4, payload.length)
    aligned.set(payload)
    const a = decodePayload(aligned) as Extract<StageFrame, { kind: 'activation' }>
    expect(a.data.buffer).toBe(aligned.buffer)
    const odd = new Uint8Array(new ArrayBuffer(payload.length + 8), 1, payload.length)
    odd.set(payload)
    const b = decodePayload(odd) as Extract<StageFrame, { kind: 'activation' }>
    expect(b.data.buffer).not.toBe(odd.buffer)
    expect([...b.data]).toEqual([1, 2, 3, 4])
  })

  it('refuses truncated frames', () => {
    const act = payloadOf({ kind: 'activation', requestId: 'ab', start: 0, final: true, rows: 2, width: 2, data: Float32Array.of(1, 2, 3, 4) })
    for (const cut of [2, 4, 10, act.length - 1]) {
      expect(() => decodePayload(act.subarray(0, cut))).toThrow(expect.objectContaining({ code: 'SHOAL_ERR_STAGE_TRUNCATED' }))
    }
    const tok = payloadOf({ kind: 'token', requestId: 'r', position: 1, tokenId: 2 })
    expect(() => decodePayload(tok.subarray(0, tok.length - 1))).toThrow(expect.objectContaining({ code: 'SHOAL_ERR_STAGE_TRUNCATED' }))
  })

  it('refuses a wrong version and an unknown kind', () => {
    const tok = payloadOf({ kind: 'token', requestId: 'r', position: 1, tokenId: 2 })
    const v2 = tok.slice()
    v2[0] = STAGE_WIRE_VERSION + 1
    expect(() => decodePayload(v2)).toThrow(expect.objectContaining({ name: 'StageWireError', code: 'SHOAL_ERR_STAGE_UNSUPPORTED_VERSION' }))
    const k = tok.slice()
    k[1] = 99
    expect(() => decodePayload(k)).toThrow(expect.objectContaining({ code: 'SHOAL_ERR_STAGE_UNKNOWN_KIND' }))
  })

  it('refuses malformed bodies', () => {
    const act = payloadOf({ kind: 'activation', requestId: 'ab', start: 0, final: true, rows: 1, width: 1, data: Float32Array.of(1) })
    const long = Uint8Array.from([...act, 0, 0, 0, 0])
    expect(() => decodePayload(long)).toThrow(expect.objectContaining({ code: 'SHOAL_ERR_STAGE_MALFORMED' }))
    const dtype = act.slice()
    dtype[6] = 9 // 1-3 are f32, f16, int8
    expect(() => decodePayload(dtype)).toThrow(expect.objectContaining({ code: 'SHOAL_ERR_STAGE_MALFORMED' }))
    const noId = Uint8Array.of(2, 5, 0)
    expect(() => decodePayload(noId)).toThrow(expect.objectContaining({ code: 'SHOAL_ERR_STAGE_MALFORMED' }))
    const badOpen = payloadOf({ kind: 'open', requestId: 'x', open: { ...open, hop: 0 } })
    expect(() => decodePayload(badOpen)).toThrow(expect.objectContaining({ code: 'SHOAL_ERR_STAGE_MALFORMED' }))
  })

  it('refuses rebuilt-chain fields that do not come together, name no later hop, repeat one or name its own peer', () => {
    const from = { fromKey: 'k', fromLength: 2 }
    for (const bad of [
      { pullFrom: [{ hop: 1, peerId: 'C' }], fromTokens: [1, 2] },
      { ...from, pullFrom: [{ hop: 1, peerId: 'C' }] },
      { ...from, fromTokens: [1, 2] },
      { ...from, pullFrom: [{ hop: 1, peerId: 'C' }], fromTokens: [1] },
      { ...from, pullFrom: [{ hop: 1, peerId: 'C' }], fromTokens: [1, -2] },
      { ...from, pullFrom: [], fromTokens: [1, 2] },
      { ...from, pullFrom: [{ hop: 0, peerId: 'C' }], fromTokens: [1, 2] },
      { ...from, pullFrom: [{ hop: 2, peerId: 'C' }], fromTokens: [1, 2] },
      { ...from, pullFrom: [{ hop: 1, peerId: 'B' }], fromTokens: [1, 2] },
      { ...from, pullFrom: [{ hop: 1, peerId: 'C' }, { hop: 1, peerId: 'D' }], fromTokens: [1, 2] },
      { ...from, pullFrom: [{ hop: 1, peerId: '' }], fromTokens: [1, 2] },
    ]) {
      const body = Buffer.from(JSON.stringify({ ...open, sampling: { temperature: 0, topP: 1 }, ...bad }))
      expect(() => decodePayload(Uint8Array.of(2, 1, 1, 0x78, ...body)), JSON.stringify(bad)).toThrow(expect.objectContaining({ code: 'SHOAL_ERR_STAGE_MALFORMED' }))
    }
  })

  it('refuses prefix-reuse fields that do not come together or are out of range', () => {
    for (const bad of [{ fromKey: 'k' }, { fromLength: 3 }, { fromKey: 'k', fromLength: 0 }, { fromKey: '', fromLength: 3 }, { fromKey: 'k', fromLength: -1 }]) {
      const body = Buffer.from(JSON.stringify({ ...open, sampling: { temperature: 0, topP: 1 }, ...bad }))
      expect(() => decodePayload(Uint8Array.of(2, 1, 1, 0x78, ...body)), JSON.stringify(bad)).toThrow(expect.objectContaining({ code: 'SHOAL_ERR_STAGE_MALFORMED' }))
    }
    const many = JSON.stringify({ evict: Array.from({ length: 65 }, (_, i) => `k${i}`) })
    for (const bad of ['{}', '{"keep":"k"}', '{"length":3}', '{"keep":"k","length":0}', '{"keep":1,"length":3}', '[1]', '{"evict":[]}', '{"evict":[1]}', '{"evict":"k"}', '{"evict":[""]}', many]) {
      expect(() => decodePayload(Uint8Array.of(2, 6, 1, 0x78, ...Buffer.from(bad))), bad).toThrow(expect.objectContaining({ code: 'SHOAL_ERR_STAGE_MALFORMED' }))
    }
    expect(() => encodeFrame({ kind: 'finish', requestId: 'r', keep: { keep: 'k', length: 0 } })).toThrow(expect.objectContaining({ code: 'SHOAL_ERR_STAGE_MALFORMED' }))
    expect(() => encodeFrame({ kind: 'finish', requestId: 'r', evict: [] })).toThrow(expect.objectContaining({ code: 'SHOAL_ERR_STAGE_MALFORMED' }))
  })

  it('refuses to encode an oversized frame', () => {
    const width = 1024
    const rows = Math.ceil(MAX_FRAME_BYTES / (width * 4))
    const f: StageFrame = { kind: 'activation', requestId: 'big', start: 0, final: true, rows, width, data: new Float32Array(rows * width) }
    expect(() => encodeFrame(f)).toThrow(expect.objectContaining({ code: 'SHOAL_ERR_STAGE_TOO_LARGE' }))
    expect(() => encodeFrame(f, 1 << 30)).not.toThrow()
  })
})
