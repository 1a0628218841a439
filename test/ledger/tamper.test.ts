/**
 * Tampering on a real level log, done by opening the database directly: every edit is caught at the
 * entry it touched, by index and a typed reason — through the library and through
 * `shoal receipts verify` (exit 1), with misuse of the command exiting 2.
 */
import { mkdtemp, rm } from 'node:fs/promises'
import { tmpdir } from 'node:os'
import { join } from 'node:path'
import { Level } from 'level'
import { afterAll, beforeAll, describe, expect, it } from 'vitest'
import { signDocument } from '../../certs/signed.ts'
import { verifyLog, VERIFY_REASONS } from '../../daemon/ledger/index.ts'
import type { SignedReceipt, VerifyReport } from '../../daemon/ledger/index.ts'
import { receiptsShow, receiptsVerify } from '../../scripts/commands/receipts.ts'
import { hex64, makeSigner } from './fixtures/keys.ts'
import { entryKey, openLogCopy, writeTemplateLog } from './fixtures/template-log.ts'

const N = 10
const node = makeSigner()
const stage = makeSigner()
const attacker = makeSigner()
let root: string
let template: string
let cases = 0

beforeAll(async () => {
  root = await mkdtemp(join(tmpdir(), 'shoal-tamper-'))
  template = join(root, 'template')
  const ledger = await writeTemplateLog(template, node, stage, N, i => i % 3 === 0)
  expect(await ledger.verify()).toMatchObject({ ok: true, entries: N })
  await ledger.stop()
})
afterAll(async () => { await rm(root, { recursive: true, force: true }) })

/** A fresh copy of the template log, opened directly with level. */
async function copy (): Promise<{ dir: string, db: Level<string, string> }> {
  const dir = join(root, `case-${cases++}`)
  return { dir, db: await openLogCopy(template, dir) }
}
const key = entryKey

function expectBad (report: VerifyReport, index: number, reason: string, entriesBefore = index): void {
  expect(report.ok).toBe(false)
  expect(report.firstBad?.index).toBe(index)
  expect(report.firstBad?.reason).toBe(reason)
  expect(report.entries).toBe(entriesBefore)
}

/** Seeded, so a failure reproduces. */
function rng (seed: number): () => number {
  let s = seed >>> 0
  return () => { s = (Math.imul(s, 1664525) + 1013904223) >>> 0; return s / 2 ** 32 }
}

describe('tamper evidence', () => {
  it('the untouched log verifies through the CLI', async () => {
    const lines: string[] = []
    const report = await receiptsVerify({ data: template }, (l) => lines.push(l))
    expect(report).toMatchObject({ ok: true, entries: N })
    expect(lines.join('\n')).toMatch(/^ok: 10 entries/)
    const shown: string[] = []
    expect(await receiptsShow({ data: template, last: '3' }, (l) => shown.push(l))).toBe(3)
    expect(shown.map((l) => (JSON.parse(l) as SignedReceipt).body.id)).toEqual(['r7', 'r8', 'r9'])
    expect(await receiptsShow({ data: template }, () => {})).toBe(N)
  })

  it('changing any one byte of any entry is caught at that entry', async () => {
    const { db } = await copy()
    const rand = rng(0x5eed)
    const alphabet = 'abcdef0123456789"{}[],:xyzABC-_'
    for (let trial = 0; trial < 40; trial++) {
      const index = Math.floor(rand() * N)
      const original = (await db.get(key(index)))!
      const at = Math.floor(rand() * original.length)
      let ch = alphabet[Math.floor(rand() * alphabet.length)]!
      if (ch === original[at]) ch = ch === 'a' ? 'b' : 'a'
      await db.put(key(index), original.slice(0, at) + ch + original.slice(at + 1))
      const report = await verifyLog(db)
      expect(report.ok, `trial ${trial}: byte ${at} of entry ${index}`).toBe(false)
      expect(report.firstBad?.index, `trial ${trial}: byte ${at} of entry ${index} → ${JSON.stringify(report.firstBad)}`).toBe(index)
      expect(VERIFY_REASONS).toContain(report.firstBad?.reason)
      await db.put(key(index), original)
    }
    expect((await verifyLog(db)).ok).toBe(true)
    await db.close()
  })

  it('a changed byte is reported by `receipts verify` with exit 1 naming the entry', async () => {
    const { dir, db } = await copy()
    const text = (await db.get(key(4)))!
    await db.put(key(4), text.replace('"completionTokens":5', '"completionTokens":6'))
    await db.close()
    await expect(receiptsVerify({ data: dir }, () => {})).rejects.toMatchObject({ name: 'ExitError', exitCode: 1, message: /entry 4 \(id r4\): bad-signature/ })
  })

  it('deleting an entry — first, middle or last — is caught at its index', async () => {
    for (const index of [0, 5, N - 1]) {
      const { db } = await copy()
      await db.del(key(index))
      expectBad(await verifyLog(db), index, 'missing-entry')
      await db.close()
    }
  })

  it('deleting an entry and renumbering the rest is caught at its index', async () => {
    const { db } = await copy()
    for (let i = 5; i < N - 1; i++) await db.put(key(i), (await db.get(key(i + 1)))!)
    await db.del(key(N - 1))
    expectBad(await verifyLog(db), 5, 'index-mismatch')
    await db.close()
  })

  it('cutting the tail is caught by the head pointer; cutting it and rewriting the head needs an outside anchor', async () => {
    const { db } = await copy()
    const good = await verifyLog(db)
    await db.del(key(N - 1))
    expectBad(await verifyLog(db), N - 1, 'missing-entry')
    await db.put('m/head', JSON.stringify({ index: N - 2, hash: hex64(1), id: `r${N - 2}` }))
    expectBad(await verifyLog(db), N - 2, 'head-mismatch', N - 1)
    // With a consistent head the shorter log is internally valid: only a head hash published earlier
    // (report.headHash / `receipts verify` output) shows the cut. This is the documented limit.
    const prefix = await verifyLog(db, {})
    await db.put('m/head', JSON.stringify({ index: N - 2, hash: prefix.headHash, id: `r${N - 2}` }))
    const cut = await verifyLog(db)
    expect(cut).toMatchObject({ ok: true, entries: N - 1 })
    expect(cut.headHash).not.toBe(good.headHash)
    await db.close()
  })

  it('reordering two entries is caught at the first of them', async () => {
    const { db } = await copy()
    const a = (await db.get(key(2)))!
    const b = (await db.get(key(6)))!
    await db.put(key(2), b)
    await db.put(key(6), a)
    expectBad(await verifyLog(db), 2, 'index-mismatch')
    await db.close()
  })

  it('a signature forged with another key is caught at that entry', async () => {
    const { db } = await copy()
    const entry = JSON.parse((await db.get(key(3)))!) as SignedReceipt
    const edited = { ...entry.body, usage: { promptTokens: 1, completionTokens: 1 } }
    await db.put(key(3), JSON.stringify(signDocument(edited, attacker.secretKey)))
    expectBad(await verifyLog(db), 3, 'bad-signature')
    // Claiming to be another signer (whose peer id embeds its key) does not help: the log vouches for its signers by certificate.
    await db.put(key(3), JSON.stringify(signDocument({ ...edited, signer: attacker.peerId }, attacker.secretKey)))
    expectBad(await verifyLog(db), 3, 'unknown-signer')
    // Nor does swapping in a certificate for the attacker's key under the node's peer id.
    await db.put(key(3), JSON.stringify(signDocument(edited, attacker.secretKey)))
    await db.put(`c/${node.peerId}`, JSON.stringify(attacker.certificate))
    expectBad(await verifyLog(db), 0, 'certificate-mismatch')
    await db.close()
  })

  it('a forged embedded part is caught at its entry', async () => {
    const { db } = await copy()
    const entry = JSON.parse((await db.get(key(6)))!) as SignedReceipt
    const part = entry.body.parts[0]!
    const forgedPart = signDocument({ ...part.body, tokens: { input: 12, output: 50 } }, attacker.secretKey)
    // Even re-signed by the node itself (a node lying about a peer's work), the part does not verify.
    await db.put(key(6), JSON.stringify(signDocument({ ...entry.body, parts: [forgedPart] }, node.secretKey)))
    expectBad(await verifyLog(db), 6, 'bad-part')
    await db.close()
  })

  it('a removed id mapping is caught at its entry', async () => {
    const { db } = await copy()
    await db.del('i/r7')
    expectBad(await verifyLog(db), 7, 'id-mapping')
    await db.close()
  })

  it('misuse exits 2: missing data dir, a dir without a log, a bad --last', async () => {
    await expect(receiptsVerify({ data: join(root, 'nope') })).rejects.toMatchObject({ exitCode: 2, message: /no such data directory/ })
    await expect(receiptsVerify({ data: root })).rejects.toMatchObject({ exitCode: 2, message: /no receipt log/ })
    await expect(receiptsShow({ data: template, last: '0' })).rejects.toMatchObject({ exitCode: 2, message: /--last/ })
    await expect(receiptsShow({ data: template, last: 'x' })).rejects.toMatchObject({ exitCode: 2 })
  })

  it('a log held open (a running node) is read from a copy taken then: verified, tampering still caught, the original untouched', async () => {
    const { dir, db } = await copy()
    try {
      const lines: string[] = []
      expect(await receiptsVerify({ data: dir }, l => lines.push(l))).toMatchObject({ ok: true, entries: N })
      expect(lines[0]).toMatch(/in use by a running node; reading a copy taken at/)
      expect(await receiptsShow({ data: dir, last: '2' }, () => {})).toBe(2)
      await db.put(key(4), (await db.get(key(4)))!.replace('"r4"', '"rX"'))
      await expect(receiptsVerify({ data: dir }, () => {})).rejects.toMatchObject({ exitCode: 1, message: /^receipts: entry 4 / })
      expect(await db.get(key(5))).toBeDefined() // still open and writable
    } finally {
      await db.close()
    }
  })
})
