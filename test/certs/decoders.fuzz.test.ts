/**
 * Property tests of the decoders added for client keys and witnessed heads: whatever bytes or
 * strings arrive, `decodeClientKey` / `verifyClientKey` return a typed refusal (never throw, never
 * accept what the CA did not sign), and `decodeHeadFrame` either returns a well-formed head or throws
 * its typed wire error. Mutating any character of a real key makes it invalid.
 */
import fc from 'fast-check'
import { describe, expect, it } from 'vitest'
import { CLIENT_KEY_PREFIX, createClientKey, encodeClientKey, toBase64url, verifyClientKey } from '../../certs/index.ts'
import { createLogHead, parseLogHead } from '../../daemon/ledger/index.ts'
import { decodeHeadFrame, encodeHeadFrame } from '../../daemon/witness/index.ts'
import { makeSigner } from '../ledger/fixtures/keys.ts'
import { NOW, DAY, makeCa } from './fixtures.ts'

const ca = makeCa()
const token = encodeClientKey(createClientKey(ca.secretKey, ca.certificate, { name: 'fuzz', notBefore: new Date(NOW - DAY), notAfter: new Date(NOW + DAY) }))
const check = (t: unknown) => verifyClientKey({ caCertificate: ca.certificate, token: t, now: NOW })

describe('client key decoder', () => {
  it('never throws and never accepts arbitrary input', () => {
    fc.assert(fc.property(fc.oneof(
      fc.string(),
      fc.string().map(s => `${CLIENT_KEY_PREFIX}${s}`),
      fc.tuple(fc.json(), fc.string()).map(([j, s]) => `${CLIENT_KEY_PREFIX}${toBase64url(new TextEncoder().encode(j))}.${s}`),
      fc.anything(),
    ), (input) => {
      const r = check(input)
      expect(r.ok).toBe(false)
    }), { numRuns: 300 })
  })

  it('any one changed character of a real key makes it invalid', () => {
    expect(check(token).ok).toBe(true)
    const alphabet = 'ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_.'
    fc.assert(fc.property(fc.nat(token.length - 1), fc.constantFrom(...alphabet), (at, c) => {
      fc.pre(token[at] !== c)
      expect(check(token.slice(0, at) + c + token.slice(at + 1)).ok).toBe(false)
    }), { numRuns: 300 })
  })
})

describe('log head frame decoder', () => {
  const s = makeSigner()
  const frame = encodeHeadFrame(createLogHead({ signer: s.peerId, count: 2, hash: 'ab'.repeat(32), timestamp: 1 }, s.secretKey))
  const typed = (bytes: Uint8Array): void => {
    try {
      const head = decodeHeadFrame(bytes)
      expect(parseLogHead(head).ok).toBe(true)
    } catch (err) {
      expect((err as { code?: string }).code).toMatch(/^SHOAL_ERR_WITNESS_/)
    }
  }
  it('returns a well-formed head or a typed error for any bytes', () => {
    fc.assert(fc.property(fc.uint8Array({ maxLength: 1500 }), typed), { numRuns: 300 })
    fc.assert(fc.property(fc.json(), j => typed(Uint8Array.from([1, ...new TextEncoder().encode(j)]))), { numRuns: 300 })
    fc.assert(fc.property(fc.nat(frame.length - 1), fc.integer({ min: 0, max: 255 }), (at, b) => {
      const copy = frame.slice()
      copy[at] = b
      typed(copy)
    }), { numRuns: 300 })
  })
})
