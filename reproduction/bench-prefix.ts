/**
 * KV prefix reuse on one node: time to first token (TTFT) of a follow-up turn whose prompt is a
 * long history (the previous turn's prompt and reply) plus a short new message, with the history's
 * KV kept from the previous turn (hit) against a node that prefills everything (cold). Both run
 * the same generated random-weight model through the local service, interleaved, `--rounds`
 * times; medians are printed, with the tokens each follow-up prefilled and whether both gave the
 * same greedy tokens. By default only prompt positions are kept (bit-exact reuse), so the follow-up
 * prefills the previous reply and the new message; `--reuse-generated` keeps the reply's KV too
 * (not bit-exact: see daemon/engine/local-service.ts). Wall-clock numbers need an otherwise idle
 * machine; the ratio is steadier.
 *
 *   node reproduction/bench-prefix.ts [--size 60m] [--quant int4] [--history 2000] [--new 20] [--rounds 3] [--threads N] [--reuse-generated]
 */
import { mkdtemp, rm } from 'node:fs/promises'
import { tmpdir } from 'node:os'
import { join } from 'node:path'
import { parseArgs } from 'node:util'
import { createLocalService } from '../daemon/engine/index.ts'
import type { LocalService } from '../daemon/engine/index.ts'
import type { GenerateRequest } from '../daemon/service.ts'
import { compileShards, generateTestModel } from '../shards/index.ts'
import type { TestModelSize } from '../shards/testmodel/generate.ts'
import { lcgTokens, loadAverage, lowerMedian } from './lib/index.ts'
import { execWithServeMalloc, mallocSettings } from './lib/malloc.ts'

// The engine runs in this process, and in any child that inherits its environment: with `shoal
// serve`'s malloc settings, as served (reproduction/lib/malloc.ts).
execWithServeMalloc()

const { values: args } = parseArgs({
  options: {
    size: { type: 'string', default: '60m' },
    quant: { type: 'string', default: 'int4' },
    history: { type: 'string', default: '2000' },
    new: { type: 'string', default: '20' },
    rounds: { type: 'string', default: '3' },
    threads: { type: 'string' },
    'reuse-generated': { type: 'boolean', default: false },
  },
})
const HISTORY = Number(args.history)
const NEW = Number(args.new)
const ROUNDS = Number(args.rounds)
const threads = args.threads === undefined ? undefined : Number(args.threads)

let counter = 0
async function turn (svc: LocalService, model: string, ids: number[], maxTokens: number): Promise<{ ttftMs: number, tokens: number[] }> {
  const req: GenerateRequest = { requestId: `b${++counter}`, model, prompt: { kind: 'tokens', ids }, maxTokens, sampling: { temperature: 0, topP: 1 }, stop: [], deadline: Date.now() + 600_000 }
  const t0 = performance.now()
  let ttft = 0
  const out: number[] = []
  for await (const ev of svc.generate(req, new AbortController().signal)) {
    if (ev.type === 'delta') { if (ttft === 0) ttft = performance.now() - t0; out.push(...ev.tokenIds) }
  }
  return { ttftMs: ttft, tokens: out }
}

const dir = await mkdtemp(join(tmpdir(), 'shoal-bench-prefix-'))
try {
  await generateTestModel({ architecture: 'llama', outDir: join(dir, 'ckpt'), size: args.size as TestModelSize })
  const manifest = await compileShards({ modelDir: join(dir, 'ckpt'), outDir: join(dir, 'shard'), modelId: 'bench', quant: args.quant as 'none' | 'int8' | 'int4' })
  const common = { shardDir: join(dir, 'shard'), ...(threads === undefined ? {} : { threads }), maxSequences: 4 }
  const cold = createLocalService({ ...common, kvCacheBytes: 0 })
  const hit = createLocalService({ ...common, kvCacheBytes: 1024 * 1024 * 1024, reuseGenerated: args['reuse-generated'] })
  await cold.start()
  await hit.start()
  console.log(`## ${args.size} ${args.quant}: follow-up turn after a ${HISTORY}-token history, +${NEW} new tokens; threads ${threads ?? 'all'}; ${args['reuse-generated'] ? 'reply KV kept too' : 'prompt KV kept (bit-exact)'}; load average ${loadAverage()}; malloc: ${mallocSettings()}`)
  const vocab = manifest.shape.vocabSize
  const coldMs: number[] = []
  const hitMs: number[] = []
  let same = true
  let prefilled = 0
  for (let r = 0; r < ROUNDS; r++) {
    const history = lcgTokens(HISTORY, 100 + r, vocab)
    // Turn 1 on the reusing node keeps the history's KV (and its 8-token reply).
    const first = await turn(hit, 'bench', history, 8)
    const follow = [...history, ...first.tokens, ...lcgTokens(NEW, 900 + r, vocab)]
    const before = (await hit.stats()).prefix!.missTokens
    const h = await turn(hit, 'bench', follow, 8)
    prefilled = (await hit.stats()).prefix!.missTokens - before
    const c = await turn(cold, 'bench', follow, 8)
    if (JSON.stringify(h.tokens) !== JSON.stringify(c.tokens)) {
      same = false
      console.log(`round ${r}: hit ${JSON.stringify(h.tokens)} ≠ cold ${JSON.stringify(c.tokens)}`)
    }
    coldMs.push(c.ttftMs)
    hitMs.push(h.ttftMs)
  }
  console.log('| follow-up | TTFT p50 (ms) | tokens prefilled |\n|---|---|---|')
  console.log(`| cold (recomputed) | ${lowerMedian(coldMs).toFixed(1)} | ${HISTORY + 8 + NEW} |`)
  console.log(`| local hit | ${lowerMedian(hitMs).toFixed(1)} | ${prefilled} |`)
  console.log(`\nspeed-up ${(lowerMedian(coldMs) / lowerMedian(hitMs)).toFixed(1)}×; greedy tokens identical: ${same}`)
  await hit.stop()
  await cold.stop()
} finally {
  await rm(dir, { recursive: true, force: true })
}
