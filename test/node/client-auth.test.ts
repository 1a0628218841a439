/**
 * The daemon's client-key decision remembers keys that verified, yet refuses them the moment a
 * newer revocation list names them or their validity ends — with the same reasons as a first check.
 */
import { describe, expect, it } from 'vitest'
import { createClientKey, encodeClientKey } from '../../certs/index.ts'
import type { RevocationList } from '../../certs/index.ts'
import { createClientAuth } from '../../daemon/node/client-auth.ts'
import { DAY, NOW, makeCa, makeRevocations } from '../certs/fixtures.ts'

describe('createClientAuth', () => {
  it('accepts a key repeatedly, then refuses it once revoked or expired, with the reason', () => {
    const ca = makeCa()
    const key = createClientKey(ca.secretKey, ca.certificate, { name: 'alice', notBefore: new Date(NOW - DAY), notAfter: new Date(NOW + DAY) })
    const token = encodeClientKey(key)
    let list: RevocationList | undefined = makeRevocations(ca, 0, [])
    let clock = NOW
    const auth = createClientAuth({ caCertificate: ca.certificate, revocations: () => list, now: () => clock })
    for (let i = 0; i < 3; i++) expect(auth.check(token)).toEqual({ ok: true, client: { name: 'alice', serial: key.body.serial } })
    clock = NOW + 2 * DAY
    expect(auth.check(token)).toMatchObject({ ok: false, detail: expect.stringMatching(/^expired: /) })
    clock = NOW
    expect(auth.check(token).ok).toBe(true)
    list = makeRevocations(ca, 1, [key.body.serial])
    expect(auth.check(token)).toMatchObject({ ok: false, detail: expect.stringMatching(/^revoked: /) })
    list = undefined
    expect(auth.check(token).ok).toBe(true)
    expect(auth.check(`${token}x`)).toMatchObject({ ok: false, detail: expect.stringMatching(/^malformed: /) })
  })
})
