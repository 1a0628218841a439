/**
 * Run-ahead on and off, side by side: two daemons on the same shard, one child process each (one
 * with SHOAL_RUN_AHEAD=0), both loaded at once (an idle onnxruntime session does not spin), and the
 * openai client in this parent process sending streamed greedy completions to one, then the other,
 * reps alternating (off, on, on, off, ...). Per rep: decode tok/s of one stream (first to last
 * token), and the aggregate decode tok/s of N concurrent streams (tokens after each stream's first,
 * over the time from the first stream's first token to the last stream's last). Tokens are compared
 * between the two (greedy: they must be equal).
 *
 * Run: chrt -r 10 node reproduction/bench-run-ahead.ts --shard .cache/bench/llama-tiny-int4
 *        [--reps 6] [--tokens 128] [--prompt 128] [--streams 8]
 */
import { spawn } from 'node:child_process'
import type { ChildProcess } from 'node:child_process'
import { mkdtemp, rm } from 'node:fs/promises'
import { loadavg, tmpdir } from 'node:os'
import { join, resolve } from 'node:path'
import { performance } from 'node:perf_hooks'
import { parseArgs } from 'node:util'
import OpenAI from 'openai'
import { loadManifest } from '../shards/index.ts'
import { benchDaemon, formatLoad, lowerMedian, promptIds } from './lib/index.ts'
import { execWithServeMalloc, mallocSettings } from './lib/malloc.ts'

// The engine runs in this process, and in any child that inherits its environment: with `shoal
// serve`'s malloc settings, as served (reproduction/lib/malloc.ts).
execWithServeMalloc()

const { values: args } = parseArgs({ options: {
  shard: { type: 'string' }, reps: { type: 'string', default: '6' }, tokens: { type: 'string', default: '128' },
  prompt: { type: 'string', default: '128' }, streams: { type: 'string', default: '8' }, child: { type: 'boolean', default: false },
} })
if (args.shard === undefined) throw new Error('--shard DIR is needed')
const shard = resolve(args.shard)

if (args.child) {
  const root = await mkdtemp(join(tmpdir(), 'shoal-bench-ra-'))
  const daemon = benchDaemon(shard, root)
  const { apiUrl } = await daemon.start()
  process.stdout.write(`${apiUrl}\n`)
  process.stdin.resume()
  process.stdin.on('end', () => { void daemon.stop().finally(() => rm(root, { recursive: true, force: true })).then(() => process.exit(0)) })
} else {
  const REPS = Number(args.reps)
  const TOKENS = Number(args.tokens)
  const PROMPT = Number(args.prompt)
  const STREAMS = Number(args.streams)
  const manifest = await loadManifest(shard)

  async function start (runAhead: string | undefined): Promise<{ url: string, child: ChildProcess }> {
    const env = { ...process.env }
    if (runAhead === undefined) delete env.SHOAL_RUN_AHEAD
    else env.SHOAL_RUN_AHEAD = runAhead
    const child = spawn(process.execPath, [import.meta.filename, '--child', '--shard', shard], { stdio: ['pipe', 'pipe', 'inherit'], env })
    const url = await new Promise<string>((resolve, reject) => {
      let out = ''
      child.stdout!.setEncoding('utf8').on('data', (s: string) => { out += s; if (out.includes('\n')) resolve(out.trim()) })
      child.once('exit', code => reject(new Error(`daemon child exited ${code}`)))
    })
    return { url, child }
  }

  /** One streamed greedy completion; arrival times of its tokens. */
  async function one (client: OpenAI, salt: number): Promise<{ ids: number[], first: number, last: number }> {
    const stream = await client.completions.create({ model: manifest.modelId, prompt: promptIds(PROMPT, salt), max_tokens: TOKENS, temperature: 0, stream: true, return_token_ids: true } as OpenAI.CompletionCreateParamsStreaming)
    const ids: number[] = []
    let first = NaN
    let last = NaN
    for await (const chunk of stream) {
      const got = (chunk.choices[0] as { token_ids?: number[] } | undefined)?.token_ids ?? []
      if (got.length === 0) continue
      last = performance.now()
      if (ids.length === 0) first = last
      ids.push(...got)
    }
    return { ids, first, last }
  }

  const sides = { off: await start('0'), on: await start(undefined) }
  const clients = { off: new OpenAI({ baseURL: `${sides.off.url}/v1`, apiKey: 'b', maxRetries: 0 }), on: new OpenAI({ baseURL: `${sides.on.url}/v1`, apiKey: 'b', maxRetries: 0 }) }
  const single: Record<'off' | 'on', number[]> = { off: [], on: [] }
  const aggregate: Record<'off' | 'on', number[]> = { off: [], on: [] }
  const ids: Record<'off' | 'on', number[][]> = { off: [], on: [] }
  const loadStart = loadavg()
  try {
    for (const side of ['off', 'on'] as const) { await one(clients[side], 999); await Promise.all(Array.from({ length: STREAMS }, async (_, i) => await one(clients[side], 900 + i))) }
    for (let r = 0; r < REPS; r++) {
      for (const side of (r % 2 === 0 ? ['off', 'on'] : ['on', 'off']) as Array<'off' | 'on'>) {
        const s = await one(clients[side], r)
        single[side].push((s.ids.length - 1) / ((s.last - s.first) / 1000))
        ids[side][r] = s.ids
        const many = await Promise.all(Array.from({ length: STREAMS }, async (_, i) => await one(clients[side], 100 * (r + 1) + i)))
        const from = Math.min(...many.map(m => m.first))
        const to = Math.max(...many.map(m => m.last))
        aggregate[side].push(many.reduce((a, m) => a + m.ids.length - 1, 0) / ((to - from) / 1000))
      }
    }
  } finally {
    for (const { child } of Object.values(sides)) child.stdin!.end()
  }
  const loadEnd = loadavg()
  const f0 = (x: number): string => x.toFixed(0)
  const row = (side: string, measure: string, xs: number[]): string => `| ${side} | ${measure} | ${f0(lowerMedian(xs))} | ${f0(Math.min(...xs))}–${f0(Math.max(...xs))} | ${xs.map(f0).join(' ')} |`
  const same = ids.off.every((x, r) => JSON.stringify(x) === JSON.stringify(ids.on[r]))
  console.log(`${manifest.modelId}: prompt ${PROMPT}, ${TOKENS} tokens, ${REPS} reps alternating; load average ${formatLoad(loadStart)} → ${formatLoad(loadEnd)}; malloc: ${mallocSettings()}`)
  console.log('| run-ahead | measure | median tok/s | range | reps |')
  console.log('|---|---|---|---|---|')
  console.log(row('off', '1 stream', single.off))
  console.log(row('on', '1 stream', single.on))
  console.log(row('off', `${STREAMS} streams aggregate`, aggregate.off))
  console.log(row('on', `${STREAMS} streams aggregate`, aggregate.on))
  console.log(`single-stream tokens equal on and off: ${same ? 'yes' : 'NO'}; per-rep on/off (1 stream): ${single.on.map((x, i) => (x / single.off[i]!).toFixed(2)).join(' ')}`)
  process.exit(0)
}
