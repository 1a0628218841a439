/** /shoal/infer/1.0.0: golden bytes, round trips, and typed errors for every bad input. */
import fc from 'fast-check'
import { describe, expect, it } from 'vitest'
import { codeOf } from '../support/errors.ts'
import { decodeFrames, decodePayload, encodeFrame, INFER_PROTOCOL } from '../../daemon/routing/index.ts'
import type { InferFrame } from '../../daemon/routing/index.ts'
import type { GenerateRequest } from '../../daemon/service.ts'

const hex = (b: Uint8Array): string => Buffer.from(b).toString('hex')
const utf8hex = (s: string): string => Buffer.from(s, 'utf8').toString('hex')
const bytes = (h: string): Uint8Array => new Uint8Array(Buffer.from(h, 'hex'))

const request: GenerateRequest = {
  requestId: 'r1',
  model: 'm',
  prompt: { kind: 'tokens', ids: [1, 300] },
  maxTokens: 4,
  sampling: { temperature: 0, topP: 1, seed: 7 },
  stop: ['x'],
  deadline: 1_700_000_000_000,
}

describe('infer wire format', () => {
  it('names its protocol with a version', () => {
    expect(INFER_PROTOCOL).toBe('/shoal/infer/1.0.0')
  })

  describe('golden bytes: varint length | version 1 | kind | varint id length | id | body', () => {
    const golden: Array<[InferFrame, string]> = [
      [{ kind: 'request', requestId: 'r1', request },
        '9e01' + '01' + '01' + '027231' + utf8hex('{"model":"m","prompt":{"kind":"tokens","ids":[1,300]},"maxTokens":4,"sampling":{"temperature":0,"topP":1,"seed":7},"stop":["x"],"deadline":1700000000000}')],
      [{ kind: 'start', requestId: 'r1', event: { type: 'start', promptTokenIds: [1, 300], route: ['12D3KooA', '12D3KooB'], receiptId: 'r1' } },
        '50' + '01' + '02' + '027231' + utf8hex('{"promptTokenIds":[1,300],"route":["12D3KooA","12D3KooB"],"receiptId":"r1"}')],
      // delta: 2 token ids (300 = ac 02, 5), then "hé" in UTF-8
      [{ kind: 'delta', requestId: 'r1', event: { type: 'delta', text: 'hé', tokenIds: [300, 5] } },
        '0c' + '01' + '03' + '027231' + '02' + 'ac02' + '05' + '68c3a9'],
      [{ kind: 'end', requestId: 'r1', event: { type: 'end', finishReason: 'stop', usage: { promptTokens: 2, completionTokens: 2 } } },
        '4c' + '01' + '04' + '027231' + utf8hex('{"finishReason":"stop","usage":{"promptTokens":2,"completionTokens":2}}')],
      [{ kind: 'error', requestId: 'r1', error: { name: 'ShoalError', code: 'SHOAL_ERR_OVERLOADED', message: 'busy' } },
        '49' + '01' + '05' + '027231' + utf8hex('{"name":"ShoalError","code":"SHOAL_ERR_OVERLOADED","message":"busy"}')],
      // The field at fault travels last, only when named (frames without it are unchanged).
      [{ kind: 'error', requestId: 'r1', error: { name: 'RequestTooLongError', code: 'SHOAL_ERR_BAD_REQUEST', message: 'too long', param: 'max_tokens' } },
        '6c' + '01' + '05' + '027231' + utf8hex('{"name":"RequestTooLongError","code":"SHOAL_ERR_BAD_REQUEST","message":"too long","param":"max_tokens"}')],
      [{ kind: 'cancel', requestId: 'r1' }, '05' + '01' + '06' + '027231'],
      // Prefix routing's optional fields go last, only when present: where the prompt's KV is
      // held (a hint to the chosen node), and what the executing node reused.
      [{ kind: 'request', requestId: 'r1', request: { ...request, prefixHolder: { peerId: '12D3KooB', cachedTokens: 32 } } },
        'd501' + '01' + '01' + '027231' + utf8hex('{"model":"m","prompt":{"kind":"tokens","ids":[1,300]},"maxTokens":4,"sampling":{"temperature":0,"topP":1,"seed":7},"stop":["x"],"deadline":1700000000000,"prefixHolder":{"peerId":"12D3KooB","cachedTokens":32}}')],
      // Sent to the last node that could take it: it queues instead of refusing for its budget.
      [{ kind: 'request', requestId: 'r1', request: { ...request, soleServer: true } },
        'b001' + '01' + '01' + '027231' + utf8hex('{"model":"m","prompt":{"kind":"tokens","ids":[1,300]},"maxTokens":4,"sampling":{"temperature":0,"topP":1,"seed":7},"stop":["x"],"deadline":1700000000000,"soleServer":true}')],
      [{ kind: 'start', requestId: 'r1', event: { type: 'start', promptTokenIds: [1, 300], route: ['12D3KooA'], receiptId: 'r1', prefix: { peerId: '12D3KooA', reusedTokens: 16 } } },
        '76' + '01' + '02' + '027231' + utf8hex('{"promptTokenIds":[1,300],"route":["12D3KooA"],"receiptId":"r1","prefix":{"peerId":"12D3KooA","reusedTokens":16}}')],
    ]
    for (const [frame, expected] of golden) {
      it(`${frame.kind}`, () => {
        expect(hex(encodeFrame(frame))).toBe(expected)
        expect(decodeFrames(bytes(expected))).toEqual([frame])
      })
    }
  })

  it('keeps optional fields optional and chat names intact', () => {
    const r: GenerateRequest = {
      requestId: 'abc',
      model: 'tiny',
      prompt: { kind: 'chat', messages: [{ role: 'system', content: 'be brief' }, { role: 'user', content: 'hi', name: 'ann' }] },
      sampling: { temperature: 0.7, topP: 0.95 },
      stop: [],
      deadline: 5,
    }
    const [back] = decodeFrames(encodeFrame({ kind: 'request', requestId: 'abc', request: r }))
    expect(back).toEqual({ kind: 'request', requestId: 'abc', request: r })
    expect(back?.kind === 'request' && 'maxTokens' in back.request).toBe(false)
  })

  it('carries the manifest hash, per-hop layers and signed receipt parts when present', () => {
    const start: InferFrame = {
      kind: 'start', requestId: 'r2',
      event: { type: 'start', promptTokenIds: [1], route: ['A', 'B'], receiptId: 'r2', manifestHash: 'ab'.repeat(32), hops: [{ peerId: 'A', layers: [0, 3] }, { peerId: 'B', layers: [4, 7] }] },
    }
    const end: InferFrame = {
      kind: 'end', requestId: 'r2',
      event: { type: 'end', finishReason: 'length', usage: { promptTokens: 1, completionTokens: 3 }, receiptParts: [{ body: { peerId: 'A' }, signature: 'sig' }] },
    }
    expect(decodeFrames(encodeFrame(start))).toEqual([start])
    expect(decodeFrames(encodeFrame(end))).toEqual([end])
    const busy: InferFrame = { kind: 'error', requestId: 'r2', error: { name: 'X', code: 'SHOAL_ERR_OVERLOADED', message: 'busy', retryAfterMs: 1500 } }
    expect(decodeFrames(encodeFrame(busy))).toEqual([busy])
    // Hops and parts are bounded and shaped.
    const tooMany = { ...end, event: { ...(end as { event: object }).event, receiptParts: Array.from({ length: 65 }, () => ({})) } } as InferFrame
    expect(() => decodeFrames(encodeFrame(tooMany))).toThrowError(expect.objectContaining({ code: 'SHOAL_ERR_INFER_MALFORMED' }))
    const badHop = { ...start, event: { ...(start as { event: object }).event, hops: [{ peerId: 'A', layers: [0] }] } } as unknown as InferFrame
    expect(() => decodeFrames(encodeFrame(badHop))).toThrowError(expect.objectContaining({ code: 'SHOAL_ERR_INFER_MALFORMED' }))
  })

  it('round-trips any delta and any text prompt (property)', () => {
    fc.assert(fc.property(
      fc.string({ minLength: 1, maxLength: 40 }), fc.string({ unit: 'grapheme' }), fc.array(fc.nat({ max: 2 ** 32 - 1 }), { maxLength: 20 }),
      (id, text, tokenIds) => {
        fc.pre(Buffer.byteLength(id) <= 256)
        const delta: InferFrame = { kind: 'delta', requestId: id, event: { type: 'delta', text, tokenIds } }
        const req: InferFrame = { kind: 'request', requestId: id, request: { ...request, requestId: id, prompt: { kind: 'text', text } } }
        expect(decodeFrames(encodeFrame(delta))).toEqual([delta])
        expect(decodeFrames(encodeFrame(req))).toEqual([req])
      }))
  })

  it('decodes several frames from one buffer in order', () => {
    const a: InferFrame = { kind: 'delta', requestId: 'q', event: { type: 'delta', text: 'a', tokenIds: [1] } }
    const b: InferFrame = { kind: 'cancel', requestId: 'q' }
    expect(decodeFrames(new Uint8Array([...encodeFrame(a), ...encodeFrame(b)]))).toEqual([a, b])
  })

  describe('typed errors', () => {
    it('unknown version', () => {
      expect(codeOf(() => decodeFrames(bytes('05' + '02' + '06' + '027231')))).toBe('SHOAL_ERR_INFER_UNSUPPORTED_VERSION')
    })
    it('unknown kind', () => {
      expect(codeOf(() => decodeFrames(bytes('05' + '01' + '09' + '027231')))).toBe('SHOAL_ERR_INFER_UNKNOWN_KIND')
      expect(codeOf(() => decodeFrames(bytes('05' + '01' + '00' + '027231')))).toBe('SHOAL_ERR_INFER_UNKNOWN_KIND')
    })
    it('oversized, both ways', () => {
      const big: InferFrame = { kind: 'delta', requestId: 'r', event: { type: 'delta', text: 'x'.repeat(100), tokenIds: [] } }
      expect(codeOf(() => encodeFrame(big, 64))).toBe('SHOAL_ERR_INFER_TOO_LARGE')
      expect(codeOf(() => decodeFrames(encodeFrame(big), 64))).toBe('SHOAL_ERR_INFER_TOO_LARGE')
    })
    it('truncated', () => {
      const whole = encodeFrame({ kind: 'request', requestId: 'r1', request })
      expect(codeOf(() => decodeFrames(whole.subarray(0, whole.length - 1)))).toBe('SHOAL_ERR_INFER_TRUNCATED')
      expect(codeOf(() => decodeFrames(bytes('02' + '0106')))).toBe('SHOAL_ERR_INFER_TRUNCATED')
      expect(codeOf(() => decodeFrames(bytes('04' + '0106' + '0572')))).toBe('SHOAL_ERR_INFER_TRUNCATED')
    })
    it('malformed bodies', () => {
      const frame = (kind: number, body: string): Uint8Array => {
        const payload = [1, kind, 2, 0x72, 0x31, ...Buffer.from(body, 'utf8')]
        return new Uint8Array([payload.length, ...payload])
      }
      expect(codeOf(() => decodeFrames(frame(1, '{"model":')))).toBe('SHOAL_ERR_INFER_MALFORMED')
      expect(codeOf(() => decodeFrames(frame(1, '{"model":"m","prompt":{"kind":"x"},"sampling":{"temperature":0,"topP":1},"stop":[],"deadline":1}')))).toBe('SHOAL_ERR_INFER_MALFORMED')
      expect(codeOf(() => decodeFrames(frame(1, '{"model":"m","prompt":{"kind":"tokens","ids":[-1]},"sampling":{"temperature":0,"topP":1},"stop":[],"deadline":1}')))).toBe('SHOAL_ERR_INFER_MALFORMED')
      expect(codeOf(() => decodeFrames(frame(4, '{"finishReason":"maybe","usage":{"promptTokens":1,"completionTokens":1}}')))).toBe('SHOAL_ERR_INFER_MALFORMED')
      expect(codeOf(() => decodeFrames(frame(6, 'x')))).toBe('SHOAL_ERR_INFER_MALFORMED')
      // prefix hints that are not {peerId, count}
      const payload = (kind: number, body: string): Uint8Array => new Uint8Array([1, kind, 2, 0x72, 0x31, ...Buffer.from(body, 'utf8')])
      const req = (holder: string): string => `{"model":"m","prompt":{"kind":"tokens","ids":[1]},"sampling":{"temperature":0,"topP":1},"stop":[],"deadline":1,"prefixHolder":${holder}}`
      expect(codeOf(() => decodePayload(payload(1, req('{"peerId":"p","cachedTokens":-1}'))))).toBe('SHOAL_ERR_INFER_MALFORMED')
      expect(codeOf(() => decodePayload(payload(1, req('{"peerId":"","cachedTokens":3}'))))).toBe('SHOAL_ERR_INFER_MALFORMED')
      expect(codeOf(() => decodePayload(payload(1, req('"p"'))))).toBe('SHOAL_ERR_INFER_MALFORMED')
      // soleServer is true or absent
      const sole = (v: string): string => `{"model":"m","prompt":{"kind":"tokens","ids":[1]},"sampling":{"temperature":0,"topP":1},"stop":[],"deadline":1,"soleServer":${v}}`
      expect(codeOf(() => decodePayload(payload(1, sole('false'))))).toBe('SHOAL_ERR_INFER_MALFORMED')
      expect(codeOf(() => decodePayload(payload(1, sole('"yes"'))))).toBe('SHOAL_ERR_INFER_MALFORMED')
      expect(codeOf(() => decodePayload(payload(2, '{"promptTokenIds":[1],"route":[],"receiptId":"r1","prefix":{"peerId":"p","reusedTokens":1.5}}')))).toBe('SHOAL_ERR_INFER_MALFORMED')
      // delta whose text is not UTF-8, and one whose count runs past the frame
      expect(codeOf(() => decodePayload(bytes('0103027231' + '00' + 'ff')))).toBe('SHOAL_ERR_INFER_MALFORMED')
      expect(codeOf(() => decodePayload(bytes('0103027231' + '03' + '01')))).toBe('SHOAL_ERR_INFER_MALFORMED')
      // empty request id
      expect(codeOf(() => decodePayload(bytes('010600')))).toBe('SHOAL_ERR_INFER_MALFORMED')
      expect(codeOf(() => encodeFrame({ kind: 'cancel', requestId: '' }))).toBe('SHOAL_ERR_INFER_MALFORMED')
      expect(codeOf(() => encodeFrame({ kind: 'request', requestId: 'other', request }))).toBe('SHOAL_ERR_INFER_MALFORMED')
    })
    it('any byte string either decodes or fails with an InferWireError (property)', () => {
      fc.assert(fc.property(fc.uint8Array({ maxLength: 64 }), (b) => {
        try {
          decodePayload(b)
        } catch (err) {
          expect((err as Error).name).toBe('InferWireError')
          expect((err as { code: string }).code).toMatch(/^SHOAL_ERR_INFER_/)
        }
      }))
    })
  })
})
