/**
 * Signed log heads and witnessed verification. The head format and its /shoal/heads frame are
 * pinned byte for byte (the worked example's key and entry hash); a log whose tail was cut and whose
 * head pointer was rewritten to match passes `receipts verify` alone — and fails it with the heads
 * a peer witnessed, as does a log rewritten at a witnessed index. Heads of other signers are not
 * this log's; heads that do not verify are skipped and counted.
 */
import { cp, mkdtemp, rm, writeFile } from 'node:fs/promises'
import { tmpdir } from 'node:os'
import { join } from 'node:path'
import { createHash } from 'node:crypto'
import { Level } from 'level'
import { afterAll, beforeAll, describe, expect, it } from 'vitest'
import canonicalizeModule from 'canonicalize'
import {
  GENESIS_HASH, WITNESSED_HEADS_FORMAT, chooseHead, createLedger, createLogHead, entryHash, headsFromFile, parseLogHead, verifyLog, verifyLogHead,
} from '../../daemon/ledger/index.ts'
import type { SignedLogHead, SignedReceipt } from '../../daemon/ledger/index.ts'
import { decodeHeadFrame, encodeHeadFrame } from '../../daemon/witness/index.ts'
import { receiptsVerify } from '../../scripts/commands/receipts.ts'
import { makeSigner, sampleInput, seedOf } from './fixtures/keys.ts'

const canonicalize = canonicalizeModule as unknown as (v: unknown) => string

describe('signed log head (shoal.log-head/1)', () => {
  it('has pinned bytes: JCS body, ed25519 signature, and the /shoal/heads frame (golden)', () => {
    const signer = makeSigner(seedOf(1))
    expect(signer.peerId).toBe('12D3KooWK99VoVxNE7XzyBwXEzW7xhK7Gpv85r9F3V3fyKSUKPH5')
    const head = createLogHead({ signer: signer.peerId, count: 1, hash: '854afe7229b5e4903b2a13b9b36431302f8a290ffe6b264cea091b36e146370b', timestamp: 1767225600300 }, signer.secretKey)
    const jcs = '{"count":1,"format":"shoal.log-head/1","hash":"854afe7229b5e4903b2a13b9b36431302f8a290ffe6b264cea091b36e146370b","signer":"12D3KooWK99VoVxNE7XzyBwXEzW7xhK7Gpv85r9F3V3fyKSUKPH5","timestamp":1767225600300}'
    expect(canonicalize(head.body)).toBe(jcs)
    expect(head.signature).toBe('SsxrlfH8ImvoSqkV-c05IUz3uOQ8SS5tr1sxnrka1Nym6DoeHiszwR8HUI4cw2FZWDg0dSJ68JPmJ1tCJHmmDQ')
    expect(verifyLogHead(head, signer.publicKey)).toBe(true)
    const frame = encodeHeadFrame(head)
    expect(frame[0]).toBe(1)
    expect(Buffer.from(frame.subarray(1)).toString('utf8')).toBe(`{"body":${jcs},"signature":"${head.signature}"}`)
    expect(createHash('sha256').update(frame).digest('hex')).toBe('2753a3611ff89be973e5cb8bb1e1ae607fd9264a90cd7490b9f2d90f436e2efc')
    expect(decodeHeadFrame(frame)).toEqual(head)
  })

  it('refuses malformed heads and frames with typed errors', () => {
    const s = makeSigner()
    const good = createLogHead({ signer: s.peerId, count: 3, hash: 'ab'.repeat(32), timestamp: 5 }, s.secretKey)
    for (const body of [
      { ...good.body, count: -1 }, { ...good.body, count: 1.5 }, { ...good.body, hash: 'AB'.repeat(32) }, { ...good.body, extra: 1 },
      { ...good.body, format: 'shoal.log-head/2' }, { ...good.body, count: 0 }, { ...good.body, signer: '' }, { ...good.body, timestamp: -5 },
    ]) expect(parseLogHead({ body, signature: good.signature }).ok, JSON.stringify(body)).toBe(false)
    expect(parseLogHead({ ...good, x: 1 }).ok).toBe(false)
    expect(parseLogHead({ body: good.body, signature: 'short' }).ok).toBe(false)
    expect(() => createLogHead({ signer: s.peerId, count: 0, hash: 'ab'.repeat(32), timestamp: 1 }, s.secretKey)).toThrow(/genesis/)
    expect(createLogHead({ signer: s.peerId, count: 0, hash: GENESIS_HASH, timestamp: 1 }, s.secretKey).body.count).toBe(0)
    const frame = encodeHeadFrame(good)
    const v2 = frame.slice(); v2[0] = 2
    expect(() => decodeHeadFrame(v2)).toThrow(expect.objectContaining({ code: 'SHOAL_ERR_WITNESS_UNSUPPORTED_VERSION' }))
    for (const bad of [new Uint8Array([1]), new Uint8Array([1, 0xff, 0xfe]), new Uint8Array(2000).fill(1), Uint8Array.from([1, ...Buffer.from('{"body":{}}')])]) {
      expect(() => decodeHeadFrame(bad)).toThrow(expect.objectContaining({ code: 'SHOAL_ERR_WITNESS_MALFORMED' }))
    }
    expect(verifyLogHead({ body: { ...good.body, count: 4 }, signature: good.signature }, s.publicKey)).toBe(false)
  })

  it('a witness keeps the newest head and never a shrunk or forked one', () => {
    const b = (count: number, hash: string, timestamp: number) => ({ format: 'shoal.log-head/1' as const, signer: 'p', count, hash, timestamp })
    const h = 'aa'.repeat(32)
    expect(chooseHead(undefined, b(1, h, 1))).toBe('take')
    expect(chooseHead(b(5, h, 1), b(6, 'bb'.repeat(32), 2))).toBe('take')
    expect(chooseHead(b(5, h, 1), b(5, h, 9))).toBe('take')
    expect(chooseHead(b(5, h, 9), b(5, h, 1))).toBe('keep')
    expect(chooseHead(b(5, h, 1), b(4, h, 9))).toBe('shrunk')
    expect(chooseHead(b(5, h, 1), b(5, 'cc'.repeat(32), 9))).toBe('forked')
  })
})

describe('verify against witnessed heads', () => {
  const N = 8
  const node = makeSigner()
  const other = makeSigner()
  let root: string
  let template: string
  let hashes: string[]
  let n = 0

  beforeAll(async () => {
    root = await mkdtemp(join(tmpdir(), 'shoal-heads-'))
    template = join(root, 'template')
    const ledger = createLedger({ dataDir: template, signer: node })
    await ledger.start()
    hashes = []
    for (let i = 0; i < N; i++) hashes.push(entryHash(await ledger.append(sampleInput(`r${i}`, i, [node.peerId]))))
    expect(ledger.head).toEqual({ count: N, hash: hashes[N - 1] })
    await ledger.stop()
  })
  afterAll(async () => { await rm(root, { recursive: true, force: true }) })

  const head = (count: number, signer = node, hash = hashes[count - 1]!): SignedLogHead =>
    createLogHead({ signer: signer.peerId, count, hash, timestamp: 1_767_225_600_000 + count }, signer.secretKey)

  /** A copy of the log cut back to `keep` entries with its head pointer rewritten to match: valid on its own. */
  async function truncated (keep: number): Promise<string> {
    const dir = join(root, `cut-${n++}`)
    await cp(template, dir, { recursive: true })
    const db = new Level<string, string>(join(dir, 'receipts'), { valueEncoding: 'utf8' })
    await db.open()
    for (let i = keep; i < N; i++) {
      const key = `e/${String(i).padStart(16, '0')}`
      const entry = JSON.parse((await db.get(key))!) as SignedReceipt
      await db.del(key)
      await db.del(`i/${entry.body.id}`)
    }
    await db.put('m/head', JSON.stringify({ index: keep - 1, hash: hashes[keep - 1], id: `r${keep - 1}` }))
    await db.close()
    return dir
  }

  it('a cut tail with a rewritten head pointer passes alone and fails against a witnessed head, through the library and the CLI', async () => {
    const dir = await truncated(5)
    expect(await receiptsVerify({ data: dir }, () => {})).toMatchObject({ ok: true, entries: 5 })

    const db = new Level<string, string>(join(dir, 'receipts'), { valueEncoding: 'utf8' })
    await db.open()
    try {
      // A head from before the cut (count 3) is consistent; one from after it (count 7) is not.
      expect(await verifyLog(db, { witnessedHeads: [head(3)] })).toMatchObject({ ok: true, witness: { applied: 1, badSignature: 0, newest: { count: 3 } } })
      const report = await verifyLog(db, { witnessedHeads: [head(3), head(7), head(2, other, 'ab'.repeat(32))] })
      expect(report).toMatchObject({ ok: false, entries: 5, firstBad: { index: 5, reason: 'witnessed-head' } })
      expect(report.firstBad?.detail).toMatch(/held 7 entries .* it holds 5 \(the tail was cut\)/)
      // Only heads of this log's signer count; a forged one is skipped and counted.
      const forged = { body: { ...head(7).body, count: 8, hash: hashes[7]! }, signature: head(7).signature }
      expect(await verifyLog(db, { witnessedHeads: [head(8, other, 'cd'.repeat(32)), forged] })).toMatchObject({ ok: true, witness: { applied: 0, badSignature: 1 } })
    } finally {
      await db.close()
    }

    const heads = join(root, 'witnessed-heads.json')
    await writeFile(heads, JSON.stringify({ format: WITNESSED_HEADS_FORMAT, heads: { [node.peerId]: head(7), [other.peerId]: head(1, other, 'ef'.repeat(32)) } }))
    await expect(receiptsVerify({ data: dir, heads: [heads] }, () => {})).rejects.toMatchObject({ exitCode: 1, message: /entry 5: witnessed-head: .*held 7 entries/ })
    const lines: string[] = []
    expect(await receiptsVerify({ data: template, heads: [heads] }, l => lines.push(l))).toMatchObject({ ok: true, entries: N })
    expect(lines.join('\n')).toMatch(/witness: consistent with 1 witnessed head of this log's signer; the newest saw 7 entries/)
    await writeFile(join(root, 'junk.json'), '{"x":1}')
    await expect(receiptsVerify({ data: template, heads: [join(root, 'junk.json')] }, () => {})).rejects.toMatchObject({ exitCode: 2, message: /not a witnessed-heads file/ })
    await expect(receiptsVerify({ data: template, heads: [join(root, 'none.json')] }, () => {})).rejects.toMatchObject({ exitCode: 2, message: /no such file/ })
  })

  it('a log rewritten at a witnessed index fails there', async () => {
    const db = new Level<string, string>(join(template, 'receipts'), { valueEncoding: 'utf8' })
    await db.open()
    try {
      const report = await verifyLog(db, { witnessedHeads: [head(4, node, 'ab'.repeat(32))] })
      expect(report).toMatchObject({ ok: false, firstBad: { index: 3, reason: 'witnessed-head' } })
      expect(report.firstBad?.detail).toMatch(/the log was rewritten/)
    } finally {
      await db.close()
    }
  })

  it('reads a witness file, a bare array and a single head; counts the malformed', () => {
    const h = head(2)
    expect(headsFromFile({ format: WITNESSED_HEADS_FORMAT, heads: { a: h, b: { nope: 1 } } })).toEqual({ heads: [h], malformed: 1 })
    expect(headsFromFile([h, h])).toEqual({ heads: [h, h], malformed: 0 })
    expect(headsFromFile(h)).toEqual({ heads: [h], malformed: 0 })
    expect(headsFromFile('x')).toEqual({ heads: [], malformed: 1 })
  })
})
