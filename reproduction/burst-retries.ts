/**
 * What a burst of concurrent requests gets from a lone daemon at a mesh node's admission budget
 * (1 s: `budgets.batchBudgetMs`' default, which `shoal serve` raises to the request timeout), sent
 * by the official openai client with its default retries (two, each after the server's
 * `retry-after-ms`). A burst beyond the free sequence slots or the batch queue is refused with a
 * hint; whether the refused requests come back and get in before the client's retries run out is
 * what the hints decide (daemon/engine/admission.ts `slotRefusalHint`, daemon/batcher/refusal.ts).
 *
 *   node reproduction/burst-retries.ts --shard DIR [--requests 32] [--tokens 128] [--rounds 2] [--prompt 128]
 *
 * Run it from each checkout to compare (a `git worktree` of the base commit). Per round: requests
 * completed and failed (with their status), the round's wall time, and the 429s the client was
 * answered with their `retry-after-ms`; an untimed round of eight short requests first.
 */
import { mkdtemp, rm } from 'node:fs/promises'
import { tmpdir } from 'node:os'
import { join } from 'node:path'
import { performance } from 'node:perf_hooks'
import { parseArgs } from 'node:util'
import OpenAI from 'openai'
import { loadManifest } from '../shards/index.ts'
import { benchDaemon, gitDescribe, loadAverage, lscpuModel, promptIds } from './lib/index.ts'
import { execWithServeMalloc } from './lib/malloc.ts'

// The engine runs in this process, and in any child that inherits its environment: with `shoal
// serve`'s malloc settings, as served (reproduction/lib/malloc.ts).
execWithServeMalloc()

const { values: args } = parseArgs({
  options: {
    shard: { type: 'string' },
    requests: { type: 'string', default: '32' },
    tokens: { type: 'string', default: '128' },
    rounds: { type: 'string', default: '2' },
    prompt: { type: 'string', default: '128' },
  },
})
if (args.shard === undefined) throw new Error('--shard DIR is needed (a compiled shard directory)')
const N = Number(args.requests)
const TOKENS = Number(args.tokens)
const PROMPT = Number(args.prompt)
const manifest = await loadManifest(args.shard)
const loadStart = loadAverage(2)

const root = await mkdtemp(join(tmpdir(), 'shoal-burst-'))
const daemon = benchDaemon(args.shard, root)
try {
  const { apiUrl } = await daemon.start()
  // The SDK's defaults: two retries, each after the server's retry-after-ms. Every 429 it is
  // answered is counted here, with its hint.
  let hints: number[] = []
  const counting: typeof fetch = async (input, init) => {
    const res = await fetch(input, init)
    if (res.status === 429) hints.push(Number(res.headers.get('retry-after-ms')))
    return res
  }
  const client = new OpenAI({ baseURL: `${apiUrl}/v1`, apiKey: 'burst', fetch: counting })
  const burst = async (n: number, tokens: number, salt: number): Promise<{ ok: number, failed: Map<string, number>, s: number }> => {
    const t0 = performance.now()
    const failed = new Map<string, number>()
    let ok = 0
    await Promise.all(Array.from({ length: n }, async (_, i) => {
      try {
        await client.completions.create({ model: manifest.modelId, prompt: promptIds(PROMPT, salt + i), max_tokens: tokens, temperature: 0 })
        ok++
      } catch (err) {
        const key = String((err as { status?: number }).status ?? (err as Error).name)
        failed.set(key, (failed.get(key) ?? 0) + 1)
      }
    }))
    return { ok, failed, s: (performance.now() - t0) / 1000 }
  }
  await burst(8, 16, 9000)
  for (let round = 0; round < Number(args.rounds); round++) {
    hints = []
    const r = await burst(N, TOKENS, round * 1000)
    const failed = [...r.failed].map(([k, v]) => `${v} × ${k}`).join(', ')
    const told = hints.length === 0 ? '' : `; ${hints.length} answers 429, retry-after-ms ${Math.min(...hints)}–${Math.max(...hints)}`
    console.log(`round ${round + 1}: ${r.ok}/${N} completed${failed === '' ? '' : `, failed: ${failed}`}, ${r.s.toFixed(1)} s${told}`)
  }
} finally {
  await daemon.stop()
  await rm(root, { recursive: true, force: true })
}
console.log(`- command: node reproduction/burst-retries.ts ${process.argv.slice(2).join(' ')}`)
console.log(`- machine: ${lscpuModel()}; Node ${process.version}; git ${gitDescribe(process.cwd())}`)
console.log(`- load average (1/5/15 min): at start ${loadStart}; at end ${loadAverage(2)}`)
