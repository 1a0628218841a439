/**
 * What a receipt costs per completion: hashing the request and response, signing, and the durable
 * (fsync'd) append to the level log — one at a time, and under concurrent load where appends share
 * synced batches — compared with how long a completion itself takes.
 *
 * Run: node reproduction/bench-receipts.ts [--n 400]
 *
 * The completion times compared against are stated, not measured here: a short completion
 * (16 tokens at 100 tok/s = 160 ms, a fast small model) and a typical chat answer (256 tokens at
 * 30 tok/s ≈ 8.5 s, a 1–3B model on a laptop CPU).
 */
import { mkdtemp, rm } from 'node:fs/promises'
import { tmpdir } from 'node:os'
import { join } from 'node:path'
import { performance } from 'node:perf_hooks'
import { parseArgs } from 'node:util'
import { generateKeyPairSync } from 'node:crypto'
import { publicKeyFromRaw } from '@libp2p/crypto/keys'
import { peerIdFromPublicKey } from '@libp2p/peer-id'
import { publicKeyOf, signDocument } from '../certs/signed.ts'
import { buildReceiptInput, createLedger, GENESIS_HASH, RECEIPT_FORMAT } from '../daemon/ledger/index.ts'
import type { ReceiptBody } from '../daemon/ledger/index.ts'
import type { GenerateRequest } from '../daemon/service.ts'

const { values } = parseArgs({ options: { n: { type: 'string', default: '400' } } })
const N = Number(values.n)

const COMPLETIONS = [
  { name: 'short: 16 tok @ 100 tok/s', ms: 160 },
  { name: 'typical: 256 tok @ 30 tok/s', ms: (256 / 30) * 1000 },
]

const seed = new Uint8Array(Buffer.from(generateKeyPairSync('ed25519').privateKey.export({ format: 'jwk' }).d!, 'base64url'))
const peerId = peerIdFromPublicKey(publicKeyFromRaw(publicKeyOf(seed)) as Parameters<typeof peerIdFromPublicKey>[0]).toString()

// A typical request: a system prompt and a ~1.5 KB user message; 256 output tokens.
const request: GenerateRequest = {
  requestId: 'bench',
  model: 'qwen2.5-1.5b-instruct',
  prompt: { kind: 'chat', messages: [{ role: 'system', content: 'You are a helpful assistant.' }, { role: 'user', content: 'Summarise the following text. '.repeat(50) }] },
  maxTokens: 256,
  sampling: { temperature: 0.7, topP: 0.95, seed: 1 },
  stop: [],
  deadline: Date.now() + 60_000,
}
const tokenIds = Array.from({ length: 256 }, (_, i) => 1000 + i)
const output = { text: 'word '.repeat(256), tokenIds, finishReason: 'length' as const }
const context = {
  manifestHash: 'ab'.repeat(32),
  route: [{ peerId, layers: [0, 13] as [number, number] }, { peerId, layers: [14, 27] as [number, number] }],
  usage: { promptTokens: 420, completionTokens: 256 },
  timing: { startedAt: Date.now(), firstTokenMs: 180, totalMs: 8500 },
}
const inputFor = (id: string): ReturnType<typeof buildReceiptInput> => buildReceiptInput({ ...request, requestId: id }, output, context)

function timeSync (n: number, fn: (i: number) => void): number {
  for (let i = 0; i < Math.min(50, n); i++) fn(i) // warm up
  const t0 = performance.now()
  for (let i = 0; i < n; i++) fn(i)
  return (performance.now() - t0) / n
}

const rows: Array<[string, number]> = []
rows.push(['hash request + response (build receipt input)', timeSync(N, (i) => { inputFor(`h${i}`) })])
const body: ReceiptBody = { ...inputFor('s'), format: RECEIPT_FORMAT, index: 0, signer: peerId, timestamp: Date.now(), prevHash: GENESIS_HASH }
rows.push(['sign (JCS + ed25519)', timeSync(N, () => { signDocument(body, seed) })])

const dir = await mkdtemp(join(tmpdir(), 'shoal-bench-'))
try {
  const ledger = createLedger({ dataDir: dir, signer: { peerId, secretKey: seed } })
  await ledger.start()
  // One completion at a time: every append is its own synced batch.
  let t0 = performance.now()
  for (let i = 0; i < N; i++) await ledger.append(inputFor(`seq${i}`))
  rows.push(['build + sign + durable append, one at a time', (performance.now() - t0) / N])
  // Many completions finishing together: appends share synced batches (group commit).
  const concurrency = 32
  t0 = performance.now()
  let next = 0
  await Promise.all(Array.from({ length: concurrency }, async () => {
    while (next < N) await ledger.append(inputFor(`par${next++}`))
  }))
  rows.push([`build + sign + durable append, ${concurrency} concurrent (per completion)`, (performance.now() - t0) / N])
  t0 = performance.now()
  const report = await ledger.verify()
  if (!report.ok) throw new Error(`log does not verify: ${JSON.stringify(report.firstBad)}`)
  rows.push(['verify (per entry)', (performance.now() - t0) / report.entries])
  await ledger.stop()
} finally {
  await rm(dir, { recursive: true, force: true })
}

const pct = (ms: number, base: number): string => `${((ms / base) * 100).toFixed(3)} %`
console.log(`node ${process.version}, ${N} receipts per measurement, data dir on ${tmpdir()}\n`)
console.log(`| step | ms per completion | vs ${COMPLETIONS.map((c) => c.name).join(' | vs ')} |`)
console.log(`|---|---:|${COMPLETIONS.map(() => '---:').join('|')}|`)
for (const [name, ms] of rows) console.log(`| ${name} | ${ms.toFixed(3)} | ${COMPLETIONS.map((c) => pct(ms, c.ms)).join(' | ')} |`)
