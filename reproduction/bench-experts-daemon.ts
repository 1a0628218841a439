/**
 * MoE experts on holder daemons, through the daemon path end to end (issue 17): the same model
 * served whole by `shoal serve` (one-graph shards) vs by a stage `shoal node --model EXPERT-SHARDS`
 * whose experts live on H `shoal node --hold-experts` processes (TCP loopback, CA-issued
 * identities). Clients stream greedy completions over HTTP from this process
 * (`return_token_ids`), B independent requests at once (a concurrency sweep): a request refused
 * with 429 (both services hold 8 sequences and queue more only within their 1 s wait budget) is
 * retried after its Retry-After, as the openai client does, and its TTFT counts from the first try.
 *
 * Pinning (`--pin auto`, the default, where `taskset` works): the whole-model server and the
 * stage on core 0, holder i on core 1 + (i mod (cores − 1)); the client unpinned. On a machine
 * with fewer than 1 + H cores holders share cores, so the numbers show the protocol's overhead,
 * not scaling over holders.
 *
 * Per configuration and B: aggregate decode tok/s (all streams' tokens after their first / time
 * from the first first-token to the last token), TTFT p50 and p99, 429 retries, frame payload
 * bytes on the wire per generated token (the stage's `/v1/mesh` experts counters, prefill
 * included), and whether every stream's token ids equal the whole model's at the same B.
 *
 *   node reproduction/bench-experts-daemon.ts [--arch qwen3-moe] [--size small] [--holders 1,2,4]
 *        [--streams 1,4,16,64] [--tokens 16] [--pin auto|off]
 */
import { spawnSync, type ChildProcess } from 'node:child_process'
import { mkdtemp, rm } from 'node:fs/promises'
import { availableParallelism, loadavg, tmpdir } from 'node:os'
import { join } from 'node:path'
import { performance } from 'node:perf_hooks'
import { setTimeout as sleep } from 'node:timers/promises'
import { parseArgs } from 'node:util'
import { createThrowawayCa } from '../certs/index.ts'
import { compileExpertShards, compileShards, generateTestModel, type MoeTestArchitecture, type TestModelSize } from '../shards/index.ts'
import { tokenChunks } from './sse.ts'
import { createShoalProcesses, formatLoad, loadAverage, nearestRank, raggedPromptIds } from './lib/index.ts'

const { values } = parseArgs({
  options: {
    arch: { type: 'string', default: 'qwen3-moe' },
    size: { type: 'string', default: 'small' },
    holders: { type: 'string', default: '1,2,4' },
    streams: { type: 'string', default: '1,4,16,64' },
    tokens: { type: 'string', default: '16' },
    pin: { type: 'string', default: 'auto' },
  },
})
const ARCH = values.arch as MoeTestArchitecture
const SIZE = values.size as TestModelSize
const HOLDERS = values.holders.split(',').map(Number)
const STREAMS = values.streams.split(',').map(Number)
const TOKENS = Number(values.tokens)
const MODEL = 'bench-experts'
const daemons = createShoalProcesses()

interface Stream { ids: number[], t0: number, first: number, last: number, retries: number }

async function streamCompletion (url: string, prompt: number[]): Promise<Stream> {
  const t0 = performance.now()
  const signal = AbortSignal.timeout(300_000)
  let retries = 0
  let res: Response
  for (;;) {
    res = await fetch(`${url}/v1/completions`, {
      method: 'POST',
      headers: { 'content-type': 'application/json' },
      body: JSON.stringify({ model: MODEL, prompt, max_tokens: TOKENS, temperature: 0, stream: true, return_token_ids: true }),
      signal,
    })
    if (res.status !== 429) break
    // Busy: wait as told (seconds), then try again, as the openai client does.
    await res.body?.cancel()
    retries++
    await sleep(1000 * Math.max(0.05, Number(res.headers.get('retry-after') ?? '1')), undefined, { signal })
  }
  if (res.status !== 200) throw new Error(`HTTP ${res.status} from ${url}: ${await res.text()}`)
  const ids: number[] = []
  let first = NaN
  let last = NaN
  for await (const { ids: got, at } of tokenChunks(res.body, url)) {
    if (ids.length === 0) first = at
    last = at
    ids.push(...got)
  }
  return { ids, t0, first, last, retries }
}

interface Run { tokS: number, p50: number, p99: number, retries: number, tokens: number, wallS: number, ids: number[][] }

async function run (url: string, B: number): Promise<Run> {
  const t0 = performance.now()
  const rs = await Promise.all(Array.from({ length: B }, async (_, i) => await streamCompletion(url, raggedPromptIds(i))))
  const decoded = rs.reduce((a, r) => a + r.ids.length - 1, 0)
  const span = Math.max(...rs.map(r => r.last)) - Math.min(...rs.map(r => r.first))
  const ttfts = rs.map(r => r.first - r.t0)
  return {
    tokS: decoded / (span / 1000), p50: nearestRank(ttfts, 0.5), p99: nearestRank(ttfts, 0.99), retries: rs.reduce((a, r) => a + r.retries, 0),
    tokens: rs.reduce((a, r) => a + r.ids.length, 0), wallS: (performance.now() - t0) / 1000, ids: rs.map(r => r.ids),
  }
}

const row = (who: string, B: number, r: Run, bytes: string, same: string): string =>
  `| ${who} | ${B} | ${r.tokS.toFixed(1)} | ${r.p50.toFixed(0)} | ${r.p99.toFixed(0)} | ${r.retries} | ${bytes} | ${same} |`

interface MeshExperts { experts?: { plans: Array<{ nodes: unknown[], bytesOut: number, bytesIn: number }> } }
async function wire (url: string): Promise<{ nodes: number, bytes: number }> {
  const plan = ((await (await fetch(`${url}/v1/mesh`)).json()) as MeshExperts).experts?.plans[0]
  return { nodes: plan?.nodes.length ?? 0, bytes: (plan?.bytesOut ?? 0) + (plan?.bytesIn ?? 0) }
}

async function main (): Promise<void> {
  const cores = availableParallelism()
  const pin = values.pin !== 'off' && cores >= 2 && spawnSync('taskset', ['-c', '0', 'true']).status === 0
  // Core 0: the server or stage; holders round-robin over the rest.
  const core = (n: number): number | undefined => pin ? (n === 0 ? 0 : 1 + (n - 1) % (cores - 1)) : undefined
  const load0 = loadavg()
  let mismatches = 0
  const root = await mkdtemp(join(tmpdir(), 'shoal-bench-experts-'))
  try {
    const ckpt = join(root, 'ckpt')
    await generateTestModel({ architecture: ARCH, size: SIZE, outDir: ckpt, seed: 4, modelId: MODEL })
    const whole = join(root, 'whole')
    const experts = join(root, 'experts')
    await compileShards({ modelDir: ckpt, outDir: whole })
    const layout = await compileExpertShards({ modelDir: ckpt, outDir: experts })
    const moe = layout.shape.moe!
    const ca = await createThrowawayCa(join(root, 'pki'), ['stage', ...Array.from({ length: Math.max(...HOLDERS) }, (_, i) => `h${i}`)])
    const [is, ...ih] = ca.identities
    const cache = join(root, 'cache')
    const mesh = ['--device', 'cpu', '--no-mdns', '--listen', '/ip4/127.0.0.1/tcp/0']

    let soloUrl = ''
    const solo = await daemons.spawn('whole serve', ['serve', '--model', whole, '--api', '127.0.0.1:0', '--device', 'cpu'], core(0), cache, line => {
      const m = /^shoal: serving \S+ at (\S+)\/v1/.exec(line)
      if (m !== null) soloUrl = m[1]!
      return m !== null
    })
    console.log(`${ARCH} ${SIZE}: ${layout.shape.numLayers} layers (MoE ${moe.moeLayers.join(',')}), hidden ${layout.shape.hiddenSize}, ${moe.numExperts} experts of width ${moe.expertIntermediateSize}, top-${moe.topK}; ${TOKENS} tokens per stream, greedy; ${cores} cores, pinning ${pin ? `on (whole and stage on core 0, holder i on core 1 + (i mod ${cores - 1}); client unpinned)` : 'off'}; Node ${process.version}; load average at start ${formatLoad(load0, 2)}`)
    console.log('')
    console.log('| experts on | streams | decode tok/s (aggregate) | TTFT p50 ms | TTFT p99 ms | 429 retries | wire bytes / token | tokens = whole |')
    console.log('|---|---:|---:|---:|---:|---:|---:|---|')
    const want = new Map<number, number[][]>()
    await run(soloUrl, 4) // warm-up
    for (const B of STREAMS) {
      const r = await run(soloUrl, B)
      want.set(B, r.ids)
      console.log(row('whole model (shoal serve)', B, r, '0', '—'))
    }
    await daemons.stop([solo])

    for (const H of HOLDERS) {
      let stageUrl = ''
      const addrs: string[] = []
      const stage = await daemons.spawn('stage', ['node', '--identity', is!.dir, '--model', experts, '--api', '127.0.0.1:0', '--data', join(root, `data-stage-${H}`), ...mesh], core(0), cache, line => {
        const up = /^shoal: node \S+ up, API at (\S+)\/v1/.exec(line)
        if (up !== null) stageUrl = up[1]!
        const l = /^\s+listening on (\S+)/.exec(line)
        if (l !== null) addrs.push(l[1]!)
        return l !== null
      })
      const holders: ChildProcess[] = []
      for (let i = 0; i < H; i++) {
        holders.push(await daemons.spawn(`holder ${i}`, ['node', '--identity', ih[i]!.dir, '--hold-experts', experts, '--data', join(root, `data-h${i}-${H}`), ...addrs.flatMap(a => ['--bootstrap', a]), ...mesh], core(1 + i), cache, line => /^\s+listening on /.test(line)))
      }
      const until = Date.now() + 60_000
      while ((await wire(stageUrl)).nodes < H) {
        if (Date.now() > until) throw new Error(`the stage did not hear ${H} holders within 60 s`)
        await sleep(250)
      }
      try {
        await run(stageUrl, 4) // warm-up: holders load their experts on first use
        for (const B of STREAMS) {
          const before = await wire(stageUrl)
          const r = await run(stageUrl, B)
          const after = await wire(stageUrl)
          const same = JSON.stringify(r.ids) === JSON.stringify(want.get(B))
          if (!same) mismatches++
          console.log(row(`${H} holder process${H > 1 ? 'es' : ''}`, B, r, ((after.bytes - before.bytes) / r.tokens).toFixed(0), same ? 'yes' : 'NO'))
        }
      } finally {
        await daemons.stop([...holders, stage])
      }
    }
    console.log('')
    console.log(`${mismatches === 0 ? 'every' : `${mismatches} configuration(s) NOT:`} stream's token ids equal the whole model's at the same B`)
    console.log(`load average at end ${loadAverage(2)}`)
  } finally {
    await daemons.stop()
    await rm(root, { recursive: true, force: true })
  }
}

await main()
