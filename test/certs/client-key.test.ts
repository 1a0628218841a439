// Client API keys: the token format (golden bytes), every refusal reason, the CA directory side
// (`issueKey`, revocation through the same list) and `shoal ca key` through the real command table.
import { mkdtemp, rm } from 'node:fs/promises'
import { tmpdir } from 'node:os'
import { join } from 'node:path'
import { createPublicKey, verify } from 'node:crypto'
import { afterAll, beforeAll, describe, expect, it, vi } from 'vitest'
import { sha256 } from '@noble/hashes/sha2.js'
import {
  CLIENT_KEY_PREFIX, canonicalBytes, createCaCertificate, createClientKey, decodeClientKey, encodeClientKey, initCa, issueKey,
  issueNode, listKeys, readCaCertificateFile, readCaRevocations, revokeNode, signDocument, toBase64url, verifyClientKey,
} from '../../certs/index.ts'
import { main } from '../../scripts/cli.ts'
import { DAY, NOW, makeCa, makeRevocations } from './fixtures.ts'

let root: string
beforeAll(async () => { root = await mkdtemp(join(tmpdir(), 'shoal-client-key-')) })
afterAll(async () => { await rm(root, { recursive: true, force: true }) })

describe('client key token', () => {
  it('has pinned bytes: prefix, base64url of the JCS body, the CA signature (golden)', () => {
    const caSeed = sha256(new TextEncoder().encode('shoal worked example CA'))
    const ca = createCaCertificate(caSeed, { name: 'example-ca', notBefore: new Date('2025-01-01T00:00:00Z'), notAfter: new Date('2035-01-01T00:00:00Z') })
    const key = createClientKey(caSeed, ca, { name: 'alice', serial: '0123456789abcdef0123456789abcdef', notBefore: new Date('2025-01-01T00:00:00Z'), notAfter: new Date('2026-01-01T00:00:00Z') })
    const token = encodeClientKey(key)
    const [prefix, body, signature] = token.split('.')
    expect(`${prefix}.`).toBe(CLIENT_KEY_PREFIX)
    expect(Buffer.from(body!, 'base64url').toString('utf8')).toBe(
      '{"caKeyId":"N2loJgXYUUBePxSrkdevUCWct-SWoLL-xPiBjkxOVko","name":"alice","notAfter":"2026-01-01T00:00:00Z","notBefore":"2025-01-01T00:00:00Z","serial":"0123456789abcdef0123456789abcdef","type":"shoal.client-key","version":1}')
    expect(signature).toBe(key.signature)
    expect(signature).toBe('26Ob4ytof20klwOP075wbaNa5ZeOlwDW3FY8zyMGU49uTdpDX87Ir5DdnCpxmA0rqRcPYGYge1cCR3hN0ghaCg')
    // Checkable with nothing but node:crypto: ed25519 by the CA key over exactly the carried bytes.
    const caKey = createPublicKey({ key: { kty: 'OKP', crv: 'Ed25519', x: ca.body.publicKey }, format: 'jwk' })
    expect(verify(null, Buffer.from(body!, 'base64url'), caKey, Buffer.from(signature!, 'base64url'))).toBe(true)
    expect(verifyClientKey({ caCertificate: ca, token, now: Date.parse('2025-06-01T00:00:00Z') })).toMatchObject({ ok: true, key: { body: { name: 'alice' } } })
  })

  it('refuses, with the reason, every key that is not a valid one of this CA now', () => {
    const ca = makeCa()
    const other = makeCa('other-ca')
    const make = (over: { notBefore?: number, notAfter?: number } = {}, issuer = ca) => createClientKey(issuer.secretKey, issuer.certificate, {
      name: 'alice', notBefore: new Date(over.notBefore ?? NOW - DAY), notAfter: new Date(over.notAfter ?? NOW + DAY),
    })
    const check = (token: unknown, revocations = makeRevocations(ca, 0, [])) => verifyClientKey({ caCertificate: ca.certificate, revocations, token, now: NOW })
    const good = make()
    const token = encodeClientKey(good)
    expect(check(token)).toMatchObject({ ok: true })

    expect(check(encodeClientKey(make({}, other)))).toMatchObject({ ok: false, reason: 'wrong-ca' })
    expect(check(token, makeRevocations(ca, 1, [good.body.serial]))).toMatchObject({ ok: false, reason: 'revoked' })
    expect(check(encodeClientKey(make({ notBefore: NOW - 3 * DAY, notAfter: NOW - 2 * DAY })))).toMatchObject({ ok: false, reason: 'expired' })
    expect(check(encodeClientKey(make({ notBefore: NOW + DAY, notAfter: NOW + 2 * DAY })))).toMatchObject({ ok: false, reason: 'not-yet-valid' })
    // A body changed after signing (a longer validity) keeps the signature: bad-signature.
    const stretched = { body: { ...good.body, notAfter: '2099-01-01T00:00:00Z' }, signature: good.signature }
    expect(check(encodeClientKey(stretched))).toMatchObject({ ok: false, reason: 'bad-signature' })
    // A node certificate's signature is not a key's: the type differs, so its body is malformed here.
    const forgedType = signDocument({ ...good.body, type: 'shoal.node-certificate' }, ca.secretKey)
    expect(check(encodeClientKey(forgedType as never))).toMatchObject({ ok: false, reason: 'malformed' })
    expect(check(encodeClientKey(signDocument({ ...good.body, version: 2 }, ca.secretKey) as never))).toMatchObject({ ok: false, reason: 'unknown-format-version' })

    const [, body, sig] = token.split('.')
    const spaced = toBase64url(new TextEncoder().encode(JSON.stringify(good.body, null, 1)))
    for (const bad of [
      undefined, 42, '', 'sk-abc', token.slice(0, -1), `${token}.x`, `shoal-key.${body}`, `shoal-key.${body}.${sig}x`,
      `shoal-key.${spaced}.${sig}`, `shoal-key.${body}=.${sig}`, `shoal-key..${sig}`, `${token}${'A'.repeat(3000)}`,
      `shoal-key.${toBase64url(new Uint8Array([0xff, 0xfe]))}.${sig}`, `shoal-key.${toBase64url(canonicalBytes([1]))}.${sig}`,
    ]) {
      const r = check(bad)
      expect(r.ok, String(bad)).toBe(false)
      expect(r).toMatchObject({ reason: 'malformed' })
    }
    expect(decodeClientKey(token)).toMatchObject({ ok: true, key: good })
  })
})

describe('CA directory', () => {
  it('issues keys under names shared with nodes, lists them, and revokes them through the same list', async () => {
    const dir = join(root, 'ca-lib')
    await initCa(dir)
    const { token, key } = await issueKey(dir, { name: 'alice', days: 30 })
    expect(token.startsWith(CLIENT_KEY_PREFIX)).toBe(true)
    await expect(issueKey(dir, { name: 'alice' })).rejects.toMatchObject({ code: 'SHOAL_ERR_CA_NAME_TAKEN' })
    await issueNode(dir, { name: 'laptop', outDir: join(root, 'laptop') })
    await expect(issueKey(dir, { name: 'laptop' })).rejects.toMatchObject({ code: 'SHOAL_ERR_CA_NAME_TAKEN' })
    await expect(issueNode(dir, { name: 'alice', outDir: join(root, 'alice-node') })).rejects.toMatchObject({ code: 'SHOAL_ERR_CA_NAME_TAKEN' })
    await expect(issueKey(dir, { name: 'bob', days: 0 })).rejects.toMatchObject({ code: 'SHOAL_ERR_CA_BAD_OPTION' })
    expect(await listKeys(dir)).toEqual([{ name: 'alice', serial: key.body.serial, notAfter: key.body.notAfter, revoked: false }])

    const caCertificate = await readCaCertificateFile(join(dir, 'ca.cert.json'))
    expect(verifyClientKey({ caCertificate, revocations: await readCaRevocations(dir), token })).toMatchObject({ ok: true })
    const list = await revokeNode(dir, 'alice')
    expect(list.body.revoked).toContain(key.body.serial)
    expect(verifyClientKey({ caCertificate, revocations: list, token })).toMatchObject({ ok: false, reason: 'revoked' })
    expect((await listKeys(dir))[0]?.revoked).toBe(true)
  })
})

async function shoal (...argv: string[]): Promise<{ code: number, out: string, err: string }> {
  let out = ''
  let err = ''
  const o = vi.spyOn(process.stdout, 'write').mockImplementation((chunk: string | Uint8Array) => { out += String(chunk); return true })
  const e = vi.spyOn(process.stderr, 'write').mockImplementation((chunk: string | Uint8Array) => { err += String(chunk); return true })
  try {
    return { code: await main(argv), out, err }
  } finally {
    o.mockRestore()
    e.mockRestore()
  }
}

describe('shoal ca key', () => {
  it('prints the key on the last line; misuse exits 2 with one line; list and revoke know keys', async () => {
    const ca = join(root, 'ca-cli')
    expect((await shoal('ca', 'init', '--dir', ca)).code).toBe(0)
    const r = await shoal('ca', 'key', '--dir', ca, '--name', 'alice', '--days', '7')
    expect(r).toMatchObject({ code: 0, err: '' })
    const lines = r.out.trimEnd().split('\n')
    const token = lines[lines.length - 1]!
    expect(token).toMatch(/^shoal-key\.[A-Za-z0-9_-]+\.[A-Za-z0-9_-]{86}$/)
    expect(decodeClientKey(token)).toMatchObject({ ok: true, key: { body: { name: 'alice' } } })

    for (const [argv, pattern] of [
      [['--name', 'alice'], /already issued/],
      [['--name', 'bob', '--days', 'x'], /days/],
      [['--name', 'bad name'], /not 1-64/],
      [['--days', '3'], /--name/],
    ] as const) {
      const bad = await shoal('ca', 'key', '--dir', ca, ...argv)
      expect(bad.code).toBe(2)
      expect(bad.err).toMatch(pattern)
      expect(bad.err.trimEnd().split('\n')).toHaveLength(1)
    }
    expect((await shoal('ca', 'key', '--dir', join(root, 'nope'), '--name', 'x')).code).toBe(2)

    const list = await shoal('ca', 'list', '--dir', ca)
    expect(list.out).toMatch(/^alice\s+-\s+[0-9a-f]{32}\s+client-key\s+\S+\s+no$/m)
    expect(list.out).not.toContain(token)
    expect((await shoal('ca', 'revoke', '--dir', ca, '--name', 'alice')).code).toBe(0)
    expect((await shoal('ca', 'list', '--dir', ca)).out).toMatch(/^alice\s.*client-key\s+\S+\s+yes$/m)
    expect((await shoal('ca', 'key', '--help')).out).toContain('--days')
  })
})
