/**
 * Verifying a running node's log without stopping it: while a ledger keeps appending (it holds
 * level's lock), `shoal receipts verify` reads copies of its files; every copy is a consistent
 * prefix of the log (never a torn entry or a head pointer past the end), and copies taken later
 * hold at least as many entries.
 */
import { mkdtemp, rm } from 'node:fs/promises'
import { tmpdir } from 'node:os'
import { join } from 'node:path'
import { afterAll, beforeAll, expect, it } from 'vitest'
import { createLedger } from '../../daemon/ledger/index.ts'
import type { Ledger } from '../../daemon/ledger/index.ts'
import { receiptsVerify } from '../../scripts/commands/receipts.ts'
import { makeSigner, sampleInput } from './fixtures/keys.ts'

let root: string
let ledger: Ledger
beforeAll(async () => {
  root = await mkdtemp(join(tmpdir(), 'shoal-running-'))
  ledger = createLedger({ dataDir: root, signer: makeSigner() })
  await ledger.start()
})
afterAll(async () => {
  await ledger.stop()
  await rm(root, { recursive: true, force: true })
})

it('verifies copies of a log that is being appended to', async () => {
  let appending = true
  let n = 0
  const writer = (async () => {
    while (appending) await ledger.append(sampleInput(`live-${n}`, n++))
  })()
  const seen: number[] = []
  try {
    while (seen.length < 6) {
      const lines: string[] = []
      const report = await receiptsVerify({ data: root }, l => lines.push(l))
      expect(report.ok).toBe(true)
      expect(lines[0]).toMatch(/in use by a running node/)
      seen.push(report.entries)
    }
  } finally {
    appending = false
    await writer
  }
  expect(seen).toEqual([...seen].sort((a, b) => a - b))
  expect(seen[seen.length - 1]!).toBeGreaterThan(0)
  expect((await receiptsVerify({ data: root }, () => {})).entries).toBeLessThanOrEqual(ledger.size)
}, 60_000)
