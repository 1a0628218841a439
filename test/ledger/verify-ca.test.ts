/**
 * `verifyLog(db, { ca })` and `shoal receipts verify --ca FILE` on real level logs written by the real
 * ledger, signed by nodes of real throwaway CAs: the log must not only hang together, every entry
 * signer and part signer must hold a stored certificate from *that* CA, valid at the entry's time.
 * Lookalike certificates (same peer id and key, another CA) verify without --ca and fail with it.
 */
import { cp, mkdtemp, rm, writeFile } from 'node:fs/promises'
import { tmpdir } from 'node:os'
import { join } from 'node:path'
import { Level } from 'level'
import { afterAll, beforeAll, describe, expect, it } from 'vitest'
import { createCaCertificate, createNodeCertificate, createThrowawayCa, fromBase64url, signDocument } from '../../certs/index.ts'
import type { CaCertificate, NodeIdentity, ThrowawayCa } from '../../certs/index.ts'
import { createLedger, createReceiptPart, verifyLog } from '../../daemon/ledger/index.ts'
import type { LedgerSigner, SignedReceiptPart, VerifyReport } from '../../daemon/ledger/index.ts'
import { receiptsVerify } from '../../scripts/commands/receipts.ts'
import { hex64, makeSigner, sampleInput } from './fixtures/keys.ts'

const DAY_MS = 24 * 60 * 60 * 1000
let root: string
let caA: ThrowawayCa
let caB: ThrowawayCa
let caAFile: string
let caBFile: string
let template: string
let cases = 0
const node = (ca: ThrowawayCa, name: string): ThrowawayCa['identities'][number] => ca.identities.find((i) => i.name === name)!
const signerOf = (id: NodeIdentity): LedgerSigner => ({ peerId: id.peerId, secretKey: id.secretKey, certificate: id.certificate })

function partOf (requestId: string, by: { peerId: string, secretKey: Uint8Array }, n: number): SignedReceiptPart {
  return createReceiptPart({
    requestId, peerId: by.peerId, model: 'demo-tiny', layers: [2, 3], inputHash: hex64(n), outputHash: hex64(n + 1),
    tokens: { input: 12, output: 5 }, timing: { startedAt: 1_700_000_000_000, durationMs: 4 },
  }, by.secretKey)
}

/**
 * Appends entries `ids` to the log in `dir` as `signer`; `parts[i]` (if any) are embedded in entry
 * i, and the certificates of their signers that have one are handed to the ledger with them (as
 * the daemon does with the mesh's admitted certificates).
 */
async function writeLog (dir: string, signer: LedgerSigner, ids: string[], options: { parts?: Array<Array<{ peerId: string, secretKey: Uint8Array, certificate?: unknown }>>, now?: () => number } = {}): Promise<void> {
  const ledger = createLedger({ dataDir: dir, signer, ...(options.now === undefined ? {} : { now: options.now }) })
  await ledger.start()
  try {
    for (const [i, id] of ids.entries()) {
      const input = sampleInput(id, i, [signer.peerId])
      const by = options.parts?.[i] ?? []
      input.parts = by.map((b, k) => partOf(id, b, i * 10 + k))
      await ledger.append(input, { certificates: by.flatMap(b => b.certificate === undefined ? [] : [b.certificate]) })
    }
  } finally {
    await ledger.stop()
  }
}

/** Opens a log directly with level (as an attacker or a peer's certificate store would write it). */
async function openRaw (dir: string): Promise<Level<string, string>> {
  const db = new Level<string, string>(join(dir, 'receipts'), { valueEncoding: 'utf8' })
  await db.open()
  return db
}

/** A fresh copy of the template log, opened directly with level. */
async function copy (): Promise<{ dir: string, db: Level<string, string> }> {
  const dir = join(root, `case-${cases++}`)
  await cp(template, dir, { recursive: true })
  return { dir, db: await openRaw(dir) }
}

function expectUntrusted (report: VerifyReport, index: number, detail: RegExp): void {
  expect(report.ok).toBe(false)
  expect(report.firstBad, JSON.stringify(report.firstBad)).toMatchObject({ index, reason: 'untrusted-signer' })
  expect(report.firstBad?.detail).toMatch(detail)
  expect(report.entries).toBe(index)
}

/** A CA of the attacker's own making (fresh key), in the right format. */
function rogueCa (): { secretKey: Uint8Array, certificate: CaCertificate } {
  const secretKey = makeSigner().secretKey
  return { secretKey, certificate: createCaCertificate(secretKey, { name: 'shoal-throwaway-ca', notBefore: new Date(Date.now() - DAY_MS), notAfter: new Date(Date.now() + 365 * DAY_MS) }) }
}

beforeAll(async () => {
  root = await mkdtemp(join(tmpdir(), 'shoal-verify-ca-'))
  caA = await createThrowawayCa(join(root, 'a'), ['ingress-1', 'stage-1', 'ingress-2', { name: 'short', days: 1 }])
  caB = await createThrowawayCa(join(root, 'b'), ['outsider'])
  caAFile = join(caA.caDir, 'ca.cert.json')
  caBFile = join(caB.caDir, 'ca.cert.json')
  // Entries 0-4 by ingress-1 (parts from stage-1 in 1 and 3), then the data dir is reused by ingress-2 for 5-7.
  template = join(root, 'template')
  const stage = node(caA, 'stage-1')
  await writeLog(template, signerOf(node(caA, 'ingress-1')), ['r0', 'r1', 'r2', 'r3', 'r4'], { parts: [[], [stage], [], [stage]] })
  await writeLog(template, signerOf(node(caA, 'ingress-2')), ['r5', 'r6', 'r7'])
})
afterAll(async () => { await rm(root, { recursive: true, force: true }) })

describe('receipts verify --ca', () => {
  it('a log signed by nodes of CA A passes with --ca A, naming the CA and every signer', async () => {
    const db = await openRaw(template)
    const report = await verifyLog(db, { ca: caA.caCertificate })
    await db.close()
    expect(report).toMatchObject({ ok: true, entries: 8, ca: { name: 'shoal-throwaway-ca', keyId: caA.caCertificate.body.keyId } })
    expect(report.signers.map((s) => s.peerId)).toEqual([node(caA, 'ingress-1').peerId, node(caA, 'ingress-2').peerId])
    expect(report.partSigners).toEqual([node(caA, 'stage-1').peerId])

    const lines: string[] = []
    await receiptsVerify({ data: template, ca: caAFile }, (l) => lines.push(l))
    expect(lines[0]).toMatch(/^ok: 8 entries/)
    expect(lines.at(-1)).toBe(`ca: every signer and 1 part signer (${node(caA, 'stage-1').peerId}) chains to CA "shoal-throwaway-ca" (key id ${caA.caCertificate.body.keyId}) with a certificate valid at each receipt's time (revocation is not checked)`)
    // Without --ca nothing about a CA is claimed.
    const plain: string[] = []
    await receiptsVerify({ data: template }, (l) => plain.push(l))
    expect(plain.some((l) => l.startsWith('ca:'))).toBe(false)
  })

  it('the same log fails with --ca B (another CA) at entry 0, exit 1 naming the signer and wrong-ca', async () => {
    const db = await openRaw(template)
    expectUntrusted(await verifyLog(db, { ca: caB.caCertificate }), 0, new RegExp(`^signer ${node(caA, 'ingress-1').peerId}'s stored certificate is not valid under CA "shoal-throwaway-ca" \\(key id ${caB.caCertificate.body.keyId}\\) at the receipt time .*: wrong-ca: issued by CA ${caA.caCertificate.body.keyId}`))
    await db.close()
    await expect(receiptsVerify({ data: template, ca: caBFile }, () => {})).rejects.toMatchObject({
      name: 'ExitError', exitCode: 1, message: new RegExp(`^receipts: entry 0 \\(id r0\\): untrusted-signer: signer ${node(caA, 'ingress-1').peerId}.*wrong-ca.*\\(0 entries before it verified\\)$`),
    })
  })

  it('a self-issued lookalike certificate (same peer id and key, another CA key) verifies alone but fails --ca at the first entry it signed', async () => {
    const victim = node(caA, 'ingress-2')
    const rogue = rogueCa()
    const fields = { name: victim.name, peerId: victim.peerId, publicKey: fromBase64url(victim.certificate.body.publicKey)!, roles: ['ingress', 'worker'] as const, notBefore: new Date(Date.now() - DAY_MS), notAfter: new Date(Date.now() + DAY_MS) }
    // (a) honestly issued by the rogue CA: its caKeyId is not CA A's.
    const ownCa = createNodeCertificate(rogue.secretKey, rogue.certificate, { ...fields, roles: [...fields.roles] })
    // (b) claiming CA A as issuer, but signed with the rogue key.
    const claimsA = signDocument({ ...ownCa.body, caKeyId: caA.caCertificate.body.keyId }, rogue.secretKey)
    for (const [lookalike, check] of [[ownCa, /wrong-ca/], [claimsA, /bad-signature: the CA signature does not verify/]] as const) {
      const { dir, db } = await copy()
      await db.put(`c/${victim.peerId}`, JSON.stringify(lookalike))
      expect(await verifyLog(db)).toMatchObject({ ok: true, entries: 8 }) // internally consistent: the gap --ca closes
      expectUntrusted(await verifyLog(db, { ca: caA.caCertificate }), 5, new RegExp(`^signer ${victim.peerId}'s stored certificate .*${check.source}`))
      await db.close()
      await expect(receiptsVerify({ data: dir, ca: caAFile }, () => {})).rejects.toMatchObject({ exitCode: 1, message: /^receipts: entry 5 \(id r5\): untrusted-signer: .*\(5 entries before it verified\)$/ })
    }
  })

  it('a caller-given key must be the one the CA certified', async () => {
    const { db } = await copy()
    const victim = node(caA, 'ingress-1')
    const attacker = makeSigner()
    const entry = JSON.parse((await db.get(`e/${'0'.padStart(16, '0')}`))!) as { body: Record<string, unknown> }
    await db.put(`e/${'0'.padStart(16, '0')}`, JSON.stringify(signDocument(entry.body, attacker.secretKey)))
    const publicKeyFor = (peerId: string): Uint8Array | undefined => peerId === victim.peerId ? attacker.publicKey : undefined
    expect((await verifyLog(db, { publicKeyFor })).firstBad).toMatchObject({ index: 1, reason: 'chain-broken' }) // entry 0 itself "verifies"
    expectUntrusted(await verifyLog(db, { publicKeyFor, ca: caA.caCertificate }), 0, /the key that verified .* is not the one its certificate from CA/)
    await db.close()
  })

  it('a part signed by a node outside the CA fails at its entry, stored certificate or not', async () => {
    const dir = join(root, 'parts')
    const outsider = node(caB, 'outsider')
    const stage = node(caA, 'stage-1')
    await writeLog(dir, signerOf(node(caA, 'ingress-1')), ['p0', 'p1'], { parts: [[stage], [stage, outsider]] })
    const db = await openRaw(dir)
    // The ledger stored both part signers' certificates beside the entries, in canonical form.
    expect(JSON.parse((await db.get(`c/${outsider.peerId}`))!)).toEqual(outsider.certificate)
    expect((await verifyLog(db)).ok).toBe(true)
    expect((await verifyLog(db, { ca: caB.caCertificate })).firstBad).toMatchObject({ index: 0, reason: 'untrusted-signer' })
    expectUntrusted(await verifyLog(db, { ca: caA.caCertificate }), 1, new RegExp(`^part 1 signer ${outsider.peerId}'s stored certificate is not valid .*wrong-ca`))
    // Without its certificate in the log the part still verifies by its peer id, but nothing vouches for it.
    await db.del(`c/${outsider.peerId}`)
    expect((await verifyLog(db)).ok).toBe(true)
    expectUntrusted(await verifyLog(db, { ca: caA.caCertificate }), 1, new RegExp(`^part 1 signer ${outsider.peerId} has no readable stored certificate`))
    await db.close()
    await expect(receiptsVerify({ data: dir, ca: caAFile }, () => {})).rejects.toMatchObject({ exitCode: 1, message: /^receipts: entry 1 \(id p1\): untrusted-signer: part 1 signer/ })
  })

  it('a log that stores no certificates fails --ca at entry 0', async () => {
    const dir = join(root, 'bare')
    const bare = makeSigner()
    await writeLog(dir, { peerId: bare.peerId, secretKey: bare.secretKey }, ['b0'])
    const db = await openRaw(dir)
    expect((await verifyLog(db)).ok).toBe(true)
    expectUntrusted(await verifyLog(db, { ca: caA.caCertificate }), 0, /has no readable stored certificate/)
    await db.close()
  })

  it('validity is judged at each receipt\'s own timestamp, with the clock skew allowed', async () => {
    const dir = join(root, 'expiry')
    const short = node(caA, 'short')
    const notAfter = Date.parse(short.certificate.body.notAfter)
    const times = [Date.now(), notAfter + 60_000, notAfter + 3 * 60_000] // in; past notAfter but within the 2-min skew; past the skew
    let t = 0
    await writeLog(dir, signerOf(short), ['x0', 'x1', 'x2'], { now: () => times[t++]! })
    const db = await openRaw(dir)
    expect((await verifyLog(db)).ok).toBe(true)
    expectUntrusted(await verifyLog(db, { ca: caA.caCertificate }), 2, new RegExp(`at the receipt time ${new Date(times[2]!).toISOString()}: expired: the certificate expired at ${short.certificate.body.notAfter}`))
    await db.close()
    await expect(receiptsVerify({ data: dir, ca: caAFile }, () => {})).rejects.toMatchObject({ exitCode: 1, message: /^receipts: entry 2 \(id x2\): untrusted-signer: .*expired/ })
  })

  it('a bad --ca exits 2 with one line: missing file, not JSON, a node certificate, a broken self-signature', async () => {
    const notJson = join(root, 'not-json.json')
    await writeFile(notJson, 'hello')
    const tampered = join(root, 'tampered-ca.json')
    await writeFile(tampered, JSON.stringify({ ...caA.caCertificate, body: { ...caA.caCertificate.body, name: 'other-name' } }))
    const cases: Array<[string, RegExp]> = [
      [join(root, 'nope.json'), /no such file/],
      [root, /no such file/],
      [notJson, /not JSON/],
      [join(node(caA, 'ingress-1').dir, 'node.cert.json'), /not a valid CA certificate/],
      [tampered, /not a valid CA certificate: CA certificate: the self-signature does not verify/],
    ]
    for (const [file, message] of cases) {
      const err = await receiptsVerify({ data: template, ca: file }, () => {}).catch((e: unknown) => e)
      expect(err, file).toMatchObject({ name: 'ExitError', exitCode: 2, message })
      expect((err as Error).message).toMatch(/^receipts: --ca /)
      expect((err as Error).message).not.toContain('\n')
    }
    await expect(receiptsVerify({ data: template, ca: '' }, () => {})).rejects.toMatchObject({ exitCode: 2, message: /--ca needs a CA certificate file/ })
  })
})
