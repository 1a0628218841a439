/**
 * Did every acknowledged completion keep its receipt? Two checks: while the nodes run, each
 * acknowledged id is fetched from its ingress (`GET /v1/receipts/:id`; an ingress restarted on
 * its data directory must still have what it acknowledged before it was killed); after they
 * stopped, each node's log is verified whole (`shoal receipts verify --data DIR --ca CA`: every
 * signature, hash link and certificate) and the ids in it (`shoal receipts show`) must include
 * every id its ingress acknowledged.
 */
import { join } from 'node:path'
import { hasLog } from '../../daemon/ledger/index.ts'
import { receiptsShow, receiptsVerify } from '../../scripts/commands/receipts.ts'
import { shoal } from './cluster.ts'
import type { ChaosNode } from './cluster.ts'
import type { Acknowledged } from './load.ts'

export interface LiveCheck { checked: number, found: number, missing: Acknowledged[] }

export async function checkLive (nodes: ChaosNode[], acked: Acknowledged[], concurrency = 8): Promise<LiveCheck> {
  const missing: Acknowledged[] = []
  let found = 0
  let next = 0
  const worker = async (): Promise<void> => {
    while (next < acked.length) {
      const a = acked[next++]!
      const node = nodes.find(n => n.spec.name === a.ingress)
      let ok = false
      if (node?.url !== undefined) {
        try {
          const res = await fetch(`${node.url}/v1/receipts/${encodeURIComponent(a.receiptId)}`, { signal: AbortSignal.timeout(10_000) })
          ok = res.status === 200 && ((await res.json()) as { body?: { id?: string } }).body?.id === a.receiptId
        } catch {}
      }
      if (ok) found++
      else missing.push(a)
    }
  }
  await Promise.all(Array.from({ length: concurrency }, worker))
  return { checked: acked.length, found, missing }
}

export interface LogCheck {
  node: string
  entries: number
  /** The verifier's first line ("ok: N entries, …") or its error. */
  verify: string
  verified: boolean
  /** Acknowledged at this node and absent from its log. */
  missing: string[]
}

/** Verifies each stopped node's log and looks for its acknowledged ids; `cli` runs the real `shoal receipts`. */
export async function checkLogs (nodes: ChaosNode[], acked: Acknowledged[], caDir: string, how: 'cli' | 'library' = 'cli'): Promise<LogCheck[]> {
  const ca = join(caDir, 'ca.cert.json')
  const out: LogCheck[] = []
  for (const node of nodes) {
    if (!await hasLog(node.dataDir)) {
      if (acked.some(a => a.ingress === node.spec.name)) out.push({ node: node.spec.name, entries: 0, verify: 'no receipt log', verified: false, missing: acked.filter(a => a.ingress === node.spec.name).map(a => a.receiptId) })
      continue
    }
    let verify: string
    let verified: boolean
    const lines: string[] = []
    if (how === 'cli') {
      try {
        verify = (await shoal(['receipts', 'verify', '--data', node.dataDir, '--ca', ca])).split('\n')[0]!
        verified = verify.startsWith('ok:')
      } catch (err) {
        verify = String((err as { stderr?: string }).stderr ?? err).trim().split('\n')[0]!
        verified = false
      }
      lines.push(...(await shoal(['receipts', 'show', '--data', node.dataDir])).split('\n').filter(l => l !== ''))
    } else {
      try {
        const seen: string[] = []
        await receiptsVerify({ data: node.dataDir, ca }, l => { seen.push(l) })
        verify = seen[0]!
        verified = true
      } catch (err) {
        verify = (err as Error).message
        verified = false
      }
      await receiptsShow({ data: node.dataDir }, l => { lines.push(l) })
    }
    const ids = new Set(lines.map(l => (JSON.parse(l) as { body?: { id?: string } }).body?.id))
    out.push({
      node: node.spec.name,
      entries: lines.length,
      verify,
      verified,
      missing: acked.filter(a => a.ingress === node.spec.name && !ids.has(a.receiptId)).map(a => a.receiptId),
    })
  }
  return out
}
