/**
 * Witnessed heads on real meshes (CA-issued identities, libp2p on loopback, real ledgers): each
 * node hands its signed log head to its peer, which keeps it in DATA/witnessed-heads.json. The
 * node's log, cut back and its head pointer rewritten, passes `receipts verify` alone and fails it
 * with the peer's file; the shrunk head the cut node then signs is refused and the old one kept.
 * The running node's log is verified without stopping it (from a copy).
 */
import { readFile } from 'node:fs/promises'
import { join } from 'node:path'
import { Level } from 'level'
import { afterAll, beforeAll, describe, expect, it } from 'vitest'
import { createLedger } from '../../daemon/ledger/index.ts'
import type { Ledger } from '../../daemon/ledger/index.ts'
import { createWitness, WITNESSED_HEADS_FILE } from '../../daemon/witness/index.ts'
import type { Witness } from '../../daemon/witness/index.ts'
import { receiptsVerify } from '../../scripts/commands/receipts.ts'
import { addrOf, createThrowawayCa, startNode, tempDir, waitFor } from '../mesh/helpers.ts'
import type { TestNode } from '../mesh/helpers.ts'
import { sampleInput } from '../ledger/fixtures/keys.ts'

interface Member { node: TestNode, dataDir: string, ledger: Ledger, witness: Witness, warnings: string[] }

let tmp: Awaited<ReturnType<typeof tempDir>>
const members: Member[] = []

async function member (node: TestNode, dataDir: string): Promise<Member> {
  const signer = { peerId: node.identity.peerId, secretKey: node.identity.secretKey, certificate: node.identity.certificate }
  const m: Member = { node, dataDir, ledger: createLedger({ dataDir, signer }), witness: undefined as unknown as Witness, warnings: [] }
  await m.ledger.start()
  m.witness = createWitness({ signer, head: () => m.ledger.head, dataDir, intervalMs: 100 }, {
    mesh: node.mesh,
    logger: { warn: (_o, msg) => { m.warnings.push(msg ?? '') }, debug: () => {} },
  })
  await m.witness.start()
  return m
}

beforeAll(async () => {
  tmp = await tempDir('witness')
  const ca = await createThrowawayCa(tmp.dir, ['a', 'b'])
  const a = await startNode(ca.identities[0]!, 'tcp')
  const b = await startNode(ca.identities[1]!, 'tcp', [addrOf(a.mesh)])
  await waitFor('admitted both ways', () => a.mesh.isAdmitted(b.mesh.peerId) && b.mesh.isAdmitted(a.mesh.peerId))
  members.push(await member(a, join(tmp.dir, 'data-a')), await member(b, join(tmp.dir, 'data-b')))
})
afterAll(async () => {
  for (const m of members) {
    await m.witness.stop()
    await m.ledger.stop()
    await m.node.mesh.stop()
  }
  await tmp?.cleanup()
})

describe('witnessed log heads', () => {
  it('a peer keeps the node\'s head; a cut log then fails verification against it, and the shrunk head is refused', async () => {
    const [a, b] = members as [Member, Member]
    for (let i = 0; i < 5; i++) await a.ledger.append(sampleInput(`w${i}`, i, [a.node.mesh.peerId]))
    const want = a.ledger.head
    await waitFor('b witnessed a at 5 entries', () => b.witness.heads().some(h => h.body.signer === a.node.mesh.peerId && h.body.count === 5))
    await b.witness.stop() // flushes the file
    await b.witness.start()
    const file = JSON.parse(await readFile(join(b.dataDir, WITNESSED_HEADS_FILE), 'utf8')) as { format: string, heads: Record<string, { body: { count: number, hash: string } }> }
    expect(file.format).toBe('shoal.witnessed-heads/1')
    expect(file.heads[a.node.mesh.peerId]?.body).toMatchObject({ count: 5, hash: want.hash })
    // And a witnessed b (whose log is empty) in turn.
    await waitFor('a witnessed b', () => a.witness.heads().some(h => h.body.signer === b.node.mesh.peerId && h.body.count === 0))

    // While a runs: its log is verified from a copy, consistent with what b witnessed.
    const heads = join(b.dataDir, WITNESSED_HEADS_FILE)
    const lines: string[] = []
    expect(await receiptsVerify({ data: a.dataDir, heads: [heads] }, l => lines.push(l))).toMatchObject({ ok: true, entries: 5, witness: { applied: 1 } })
    expect(lines.join('\n')).toMatch(/in use by a running node[\s\S]*witness: consistent with 1 witnessed head/)

    // Cut a's last two entries and rewrite its head pointer: valid alone, caught by b's head.
    await a.witness.stop()
    await a.ledger.stop()
    const db = new Level<string, string>(join(a.dataDir, 'receipts'), { valueEncoding: 'utf8' })
    await db.open()
    const entry2 = JSON.parse((await db.get(`e/${'2'.padStart(16, '0')}`))!) as unknown
    for (const i of [3, 4]) {
      await db.del(`e/${String(i).padStart(16, '0')}`)
      await db.del(`i/w${i}`)
    }
    const { entryHash } = await import('../../daemon/ledger/index.ts')
    await db.put('m/head', JSON.stringify({ index: 2, hash: entryHash(entry2 as never), id: 'w2' }))
    await db.close()
    expect(await receiptsVerify({ data: a.dataDir }, () => {})).toMatchObject({ ok: true, entries: 3 })
    await expect(receiptsVerify({ data: a.dataDir, heads: [heads] }, () => {})).rejects.toMatchObject({ exitCode: 1, message: /entry 3: witnessed-head: .*held 5 entries/ })

    // a comes back on the cut log and signs its shrunk head: b refuses it, keeps 5, and says so.
    await a.ledger.start()
    expect(a.ledger.head.count).toBe(3)
    await a.witness.start()
    await a.witness.publish()
    await waitFor('b warned of a shrunk log', () => b.warnings.some(w => /shrank/.test(w)))
    expect(b.witness.heads().find(h => h.body.signer === a.node.mesh.peerId)?.body.count).toBe(5)
  }, 60_000)
})
