/**
 * Multi-turn chat over replicas: C conversations × T turns against N mesh daemons on loopback,
 * on fresh nodes per mode. Modes: `prefix` — each node keeps a KV prefix cache and routing is
 * prefix-aware (the defaults); `baseline` — the prefix cache without prefix-aware routing
 * (`prefixRouting: false`); `none` — shoal before issue 16: no prefix cache (`kvCacheMb: 0`), no
 * prefix routing, every turn prefilled whole. Every turn goes to a node's HTTP ingress drawn at random (the same seeded
 * draws in both modes: a load balancer in front of the mesh), streams its completion, and its
 * follow-up resends the whole history (previous prompt + reply + new user tokens) as token ids.
 * Reported per mode: TTFT p50/p99 of all turns and of follow-ups, turns/s and completion tok/s over
 * the whole workload's wall time, how many turns reused a kept prefix and how many prompt tokens
 * were prefilled (x-shoal-prefix-reused), and whether every reply equals the other mode's.
 *
 * The daemons are real (createDaemon with identities from a throwaway CA: libp2p over TCP on
 * loopback, admission, load polling, /shoal/infer forwarding, receipts, onnxruntime workers) and
 * share this one Node.js process; their engine workers share the machine's cores.
 *
 * Run: node reproduction/bench-multiturn.ts [--size small] [--quant none] [--nodes 3]
 *        [--conversations 16] [--turns 6] [--system 500] [--user 30] [--max-tokens 16]
 *        [--modes none,baseline,prefix] [--seed 1] [--budget-ms 60000] [--think-ms 0]
 *
 * `--think-ms` waits that long between a reply and the conversation's next turn (a user reading),
 * so that a holder's summary reaches the other nodes before the follow-up, as in a real chat.
 *
 * `--budget-ms` is the engines' wait budget (the daemon's batchBudgetMs, 1 s by default): the
 * default would refuse (429) many cold prefills of this burst on a small machine, so turns queue
 * instead; a 429 that still comes is retried after its Retry-After and counted.
 */
import { mkdtemp, rm } from 'node:fs/promises'
import { availableParallelism, cpus, tmpdir } from 'node:os'
import { join } from 'node:path'
import { performance } from 'node:perf_hooks'
import { setTimeout as sleep } from 'node:timers/promises'
import { parseArgs } from 'node:util'
import { createThrowawayCa } from '../certs/index.ts'
import { createRng } from '../daemon/engine/index.ts'
import type { Daemon } from '../daemon/node/index.ts'
import { compileShards, generateTestModel } from '../shards/index.ts'
import type { TestModelSize } from '../shards/index.ts'
import { tokenChunks } from './sse.ts'
import { benchDaemon, lcgTokens, loadAverage, nearestRank } from './lib/index.ts'
import { execWithServeMalloc, mallocSettings } from './lib/malloc.ts'

// The engine runs in this process, and in any child that inherits its environment: with `shoal
// serve`'s malloc settings, as served (reproduction/lib/malloc.ts).
execWithServeMalloc()

const { values: args } = parseArgs({
  options: {
    size: { type: 'string', default: 'small' },
    quant: { type: 'string', default: 'none' },
    nodes: { type: 'string', default: '3' },
    conversations: { type: 'string', default: '16' },
    turns: { type: 'string', default: '6' },
    system: { type: 'string', default: '500' },
    user: { type: 'string', default: '30' },
    'max-tokens': { type: 'string', default: '16' },
    modes: { type: 'string', default: 'none,baseline,prefix' },
    seed: { type: 'string', default: '1' },
    'budget-ms': { type: 'string', default: '60000' },
    'think-ms': { type: 'string', default: '0' },
  },
})
const NODES = Number(args.nodes)
const CONVERSATIONS = Number(args.conversations)
const TURNS = Number(args.turns)
const SYSTEM = Number(args.system)
const USER = Number(args.user)
const MAX_TOKENS = Number(args['max-tokens'])
const SEED = Number(args.seed)
const THINK_MS = Number(args['think-ms'])
const MODEL = 'bench-multiturn'

interface Node { name: string, peerId: string, url: string, daemon: Daemon }

async function startNodes (root: string, shardDir: string, mode: string): Promise<Node[]> {
  const ca = await createThrowawayCa(join(root, 'pki'), Array.from({ length: NODES }, (_, i) => `n${i}`))
  const nodes: Node[] = []
  for (const [i, id] of ca.identities.entries()) {
    const daemon = benchDaemon(shardDir, root, {
      identityDir: id.dir,
      listen: ['/ip4/127.0.0.1/tcp/0'],
      bootstrap: nodes.length === 0 ? [] : nodes[0]!.daemon.mesh!.libp2p.getMultiaddrs().map(a => a.toString()),
      kvCacheMb: mode === 'none' ? 0 : 512,
      prefixRouting: mode === 'prefix',
      budgets: { batchBudgetMs: Number(args['budget-ms']) },
    }, { name: String(i), log: 'silent' })
    const { peerId, apiUrl } = await daemon.start()
    nodes.push({ name: `n${i}`, peerId, url: apiUrl!, daemon })
  }
  // Every node sees every other alive, serving the model, with load.
  const deadline = Date.now() + 60_000
  for (;;) {
    const ready = nodes.every(n => nodes.filter(o => o !== n).every(o => {
      const p = n.daemon.mesh!.peers().find(x => x.peerId === o.peerId)
      return p?.state === 'alive' && p.load !== undefined && p.capabilities?.models.some(m => m.id === MODEL) === true
    }))
    if (ready) break
    if (Date.now() > deadline) throw new Error('the mesh did not form within 60 s')
    await sleep(200)
  }
  return nodes
}

interface TurnResult { conversation: number, turn: number, ttftMs: number, route: string, reused: number, promptTokens: number, ids: number[], refusals: number }

/** One turn, streamed; TTFT is from the first attempt (a 429 is retried after its Retry-After). */
async function streamTurn (url: string, prompt: number[]): Promise<Omit<TurnResult, 'conversation' | 'turn'>> {
  const t0 = performance.now()
  let refusals = 0
  let res: Response
  for (;;) {
    res = await fetch(`${url}/v1/completions`, {
      method: 'POST',
      headers: { 'content-type': 'application/json' },
      body: JSON.stringify({ model: MODEL, prompt, max_tokens: MAX_TOKENS, temperature: 0, stream: true, return_token_ids: true }),
      signal: AbortSignal.timeout(600_000),
    })
    if (res.status !== 429 || refusals >= 20) break
    refusals++
    await res.text()
    await sleep(Math.max(100, Number(res.headers.get('retry-after') ?? 1) * 1000))
  }
  if (res.status !== 200) throw new Error(`HTTP ${res.status}: ${await res.text()}`)
  let ttftMs = 0
  const ids: number[] = []
  for await (const { ids: got, at } of tokenChunks(res.body, url)) {
    if (ttftMs === 0) ttftMs = at - t0
    ids.push(...got)
  }
  return { ttftMs, route: res.headers.get('x-shoal-route') ?? '', reused: Number(res.headers.get('x-shoal-prefix-reused') ?? 0), promptTokens: prompt.length, ids, refusals }
}

interface ModeResult { mode: string, wallMs: number, cpuMs: number, turns: TurnResult[], routed: string }

async function runMode (mode: string, run: number, root: string, shardDir: string): Promise<ModeResult> {
  if (!['prefix', 'baseline', 'none'].includes(mode)) throw new Error(`unknown mode ${mode} (prefix, baseline, none)`)
  const nodes = await startNodes(join(root, `${mode}-${run}`), shardDir, mode)
  try {
    // Warm each engine (session, step-time model) with an unrelated prompt, so neither mode pays it.
    for (const n of nodes) await streamTurn(n.url, lcgTokens(64, 9_999))
    await sleep(500)
    const draw = createRng(SEED)
    const entries = Array.from({ length: CONVERSATIONS }, () => Array.from({ length: TURNS }, () => Math.floor(draw() * nodes.length)))
    const results: TurnResult[] = []
    const t0 = performance.now()
    // Every node lives in this process: its CPU time (engine workers included) is the work the
    // workload cost, much less sensitive than wall time to what else loads the machine.
    const cpu0 = process.cpuUsage()
    await Promise.all(Array.from({ length: CONVERSATIONS }, async (_, c) => {
      let prompt = [...lcgTokens(SYSTEM, 1_000 + c), ...lcgTokens(USER, 2_000 + c)]
      for (let t = 0; t < TURNS; t++) {
        const r = await streamTurn(nodes[entries[c]![t]!]!.url, prompt)
        results.push({ conversation: c, turn: t, ...r })
        prompt = [...prompt, ...r.ids, ...lcgTokens(USER, 3_000 + c * 100 + t)]
        if (THINK_MS > 0 && t + 1 < TURNS) await sleep(THINK_MS)
      }
    }))
    const wallMs = performance.now() - t0
    const cpu = process.cpuUsage(cpu0)
    const cpuMs = (cpu.user + cpu.system) / 1000
    const metrics = await Promise.all(nodes.map(async n => await (await fetch(`${n.url}/metrics`)).text()))
    const routed = ['holder', 'elsewhere', 'none'].map(o => {
      const total = metrics.reduce((s, m) => s + Number(new RegExp(`^shoal_routing_prefix_requests_total\\{outcome="${o}"\\} (\\d+)`, 'm').exec(m)?.[1] ?? 0), 0)
      return `${o} ${total}`
    }).join(', ')
    return { mode, wallMs, cpuMs, turns: results, routed }
  } finally {
    for (const n of [...nodes].reverse()) await n.daemon.stop().catch(() => {})
  }
}

const root = await mkdtemp(join(tmpdir(), 'shoal-bench-multiturn-'))
try {
  await generateTestModel({ architecture: 'llama', outDir: join(root, 'ckpt'), size: args.size as TestModelSize, modelId: MODEL })
  await compileShards({ modelDir: join(root, 'ckpt'), outDir: join(root, 'shard'), modelId: MODEL, quant: args.quant as 'none' | 'int8' | 'int4' })
  console.log(`# multi-turn: ${CONVERSATIONS} conversations × ${TURNS} turns, ${NODES} replicas (one process), model ${args.size} ${args.quant}`)
  console.log(`system ${SYSTEM} + user ${USER} tokens per turn, ${MAX_TOKENS} generated; entry node drawn at random per turn (seed ${SEED})`)
  console.log(`machine: ${cpus()[0]?.model ?? '?'} × ${availableParallelism()}; load average before: ${loadAverage()}; malloc: ${mallocSettings()}`)
  const out: ModeResult[] = []
  // A mode may be named more than once (e.g. none,prefix,none,prefix): runs alternate so that the
  // machine's load drifts over both; every prefix run is compared with the runs beside it.
  for (const [run, mode] of args.modes.split(',').entries()) {
    const r = await runMode(mode, run, root, join(root, 'shard'))
    out.push(r)
    const all = r.turns.map(t => t.ttftMs)
    const follow = r.turns.filter(t => t.turn > 0).map(t => t.ttftMs)
    const completion = r.turns.reduce((s, t) => s + t.ids.length, 0)
    const prefilled = r.turns.reduce((s, t) => s + t.promptTokens - t.reused, 0)
    const prompt = r.turns.reduce((s, t) => s + t.promptTokens, 0)
    const hits = r.turns.filter(t => t.reused > 0).length
    console.log(`\n## ${mode} (load average after: ${loadAverage()})`)
    console.log(`wall ${(r.wallMs / 1000).toFixed(1)} s; ${(r.turns.length / r.wallMs * 1000).toFixed(2)} turns/s; ${(completion / r.wallMs * 1000).toFixed(1)} completion tok/s; CPU ${(r.cpuMs / 1000).toFixed(1)} s (${(r.cpuMs / r.turns.length).toFixed(0)} ms per turn)`)
    console.log(`TTFT all turns p50 ${nearestRank(all, 0.5).toFixed(0)} ms, p99 ${nearestRank(all, 0.99).toFixed(0)} ms; follow-ups p50 ${nearestRank(follow, 0.5).toFixed(0)} ms, p99 ${nearestRank(follow, 0.99).toFixed(0)} ms`)
    const byNode = new Map<string, number>()
    for (const t of r.turns) byNode.set(t.route, (byNode.get(t.route) ?? 0) + 1)
    console.log(`turns reusing a kept prefix ${hits}/${r.turns.length}; prompt tokens prefilled ${prefilled} of ${prompt}; 429s retried ${r.turns.reduce((s, t) => s + t.refusals, 0)}`)
    console.log(`turns per node: ${[...byNode.values()].sort((x, y) => y - x).join(' / ')}; routing counter (all nodes, warm-up included): ${r.routed}`)
  }
  const key = (t: TurnResult): string => `${t.conversation}/${t.turn}`
  const follow = (m: ModeResult): number => nearestRank(m.turns.filter(t => t.turn > 0).map(t => t.ttftMs), 0.5)
  const pairs = out.flatMap((b, i) => b.mode !== 'prefix' ? [] : [out[i - 1], out[i + 1]].filter(a => a !== undefined && a.mode !== 'prefix').map(a => [a!, b] as const))
  for (const [a, b] of pairs) {
    const bIds = new Map(b.turns.map(t => [key(t), t.ids.join()]))
    const same = a.turns.every(t => bIds.get(key(t)) === t.ids.join())
    // Think time is idle for every mode alike; throughput counts the work: turns per CPU second of
    // the process (all nodes and engine workers), and wall time for what a user waits.
    console.log(`\n${b.mode} (run ${out.indexOf(b) + 1}) / ${a.mode} (run ${out.indexOf(a) + 1}): throughput (wall) ×${(a.wallMs / b.wallMs).toFixed(2)}; turns per CPU second ×${(a.cpuMs / b.cpuMs).toFixed(2)}; follow-up TTFT p50 ×${(follow(a) / follow(b)).toFixed(2)} lower; every reply identical across modes: ${same ? 'yes' : 'NO'}`)
  }
} finally {
  await rm(root, { recursive: true, force: true })
}
