/**
 * One receipt checked where it sits (the dashboard's verify button): on a real level log, a good
 * receipt passes every check, and each kind of tampering fails the check it breaks — a rewritten
 * body (signature), a forged embedded part (parts), a broken link to the entry before
 * (previous-link), and an edited next entry (next-link of this one).
 */
import { mkdtemp, rm } from 'node:fs/promises'
import { tmpdir } from 'node:os'
import { join } from 'node:path'
import { Level } from 'level'
import { afterAll, beforeAll, describe, expect, it } from 'vitest'
import { signDocument } from '../../certs/signed.ts'
import { verifyReceipt } from '../../daemon/ledger/index.ts'
import type { SignedReceipt } from '../../daemon/ledger/index.ts'
import { hex64, makeSigner } from './fixtures/keys.ts'
import { entryKey, openLogCopy, writeTemplateLog } from './fixtures/template-log.ts'

const node = makeSigner()
const stage = makeSigner()
const attacker = makeSigner()
let root: string
let template: string
let cases = 0

beforeAll(async () => {
  root = await mkdtemp(join(tmpdir(), 'shoal-verify-one-'))
  template = join(root, 'template')
  const ledger = await writeTemplateLog(template, node, stage, 4, i => i === 2)
  // Through the running ledger too: what the dashboard calls.
  expect(await ledger.verifyOne('r1')).toMatchObject({ ok: true, index: 1 })
  expect(await ledger.verifyOne('missing')).toBeUndefined()
  await ledger.stop()
})
afterAll(async () => { await rm(root, { recursive: true, force: true }) })

const key = entryKey

async function withCopy<T> (edit: (db: Level<string, string>) => Promise<void>, check: (db: Level<string, string>) => Promise<T>): Promise<T> {
  const db = await openLogCopy(template, join(root, `case-${cases++}`))
  try {
    await edit(db)
    return await check(db)
  } finally {
    await db.close()
  }
}

async function entry (db: Level<string, string>, i: number): Promise<SignedReceipt> {
  return JSON.parse((await db.get(key(i)))!) as SignedReceipt
}

const failed = (r: Awaited<ReturnType<typeof verifyReceipt>>): string[] => r!.checks.filter(c => !c.ok).map(c => c.name)

describe('verifyReceipt', () => {
  it('every receipt of an untouched log passes form, signature, parts and both links', async () => {
    await withCopy(async () => {}, async db => {
      for (let i = 0; i < 4; i++) {
        const r = await verifyReceipt(db, `r${i}`)
        expect(r).toMatchObject({ id: `r${i}`, ok: true, index: i, signer: node.peerId })
        expect(r!.checks.map(c => c.name)).toEqual(['form', 'signature', 'parts', 'previous-link', 'next-link'])
      }
    })
  })

  it('a rewritten body fails the signature check', async () => {
    const r = await withCopy(async db => {
      const e = await entry(db, 1)
      e.body.usage.completionTokens += 1
      await db.put(key(1), JSON.stringify(e))
    }, async db => await verifyReceipt(db, 'r1'))
    expect(r!.ok).toBe(false)
    // The hash changed too, so the next entry no longer links to it.
    expect(failed(r)).toEqual(['signature', 'next-link'])
  })

  it('a forged part fails the parts check', async () => {
    const r = await withCopy(async db => {
      const e = await entry(db, 2)
      e.body.parts = [signDocument({ ...e.body.parts[0]!.body, outputHash: hex64(9) }, attacker.secretKey)]
      // Re-signed by the node key so that only the part is wrong.
      await db.put(key(2), JSON.stringify(signDocument(e.body, node.secretKey)))
    }, async db => await verifyReceipt(db, 'r2'))
    expect(failed(r)).toContain('parts')
    expect(failed(r)).not.toContain('signature')
  })

  it('a re-signed entry whose prevHash was changed fails the previous link', async () => {
    const r = await withCopy(async db => {
      const e = await entry(db, 3)
      await db.put(key(3), JSON.stringify(signDocument({ ...e.body, prevHash: hex64(7) }, node.secretKey)))
    }, async db => await verifyReceipt(db, 'r3'))
    expect(failed(r)).toEqual(['previous-link'])
  })

  it('a removed previous entry fails the previous link', async () => {
    const r = await withCopy(async db => { await db.del(key(0)) }, async db => await verifyReceipt(db, 'r1'))
    expect(failed(r)).toEqual(['previous-link'])
  })
})
