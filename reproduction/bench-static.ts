/**
 * Static (NPU-shaped) graphs against the dynamic ones on onnxruntime CPU, in one process, through
 * the engine's own runners (stage-runner.ts vs static-runner.ts) over one shard directory compiled
 * with `--static CTX,CHUNK`:
 *  - decode ms/step at several context lengths (the static graphs always attend over CTX slots and
 *    copy the whole buffer once per layer per step; the dynamic ones over the live context);
 *  - prefill tok/s of a prompt (static: CHUNK positions per run, padded);
 *  - session load time, first and second (page cache warm), for the dynamic graph, the static pair,
 *    and onnxruntime's saved optimized model (optimizedModelFilePath) — the "compiled-model cache"
 *    onnxruntime could keep.
 * Greedy tokens of both paths are compared over the decode steps. No assertions: a benchmark.
 *
 * Run: node reproduction/bench-static.ts [--model CKPT] [--quant int4|none] [--ctx 1024] [--chunk 128]
 *        [--contexts 64,512,960] [--steps 40] [--threads 2] [--accuracy 4|0]
 * Without --model a 60m Llama checkpoint is generated into .cache/bench/llama-60m.
 */
import { existsSync } from 'node:fs'
import { mkdtemp, rm } from 'node:fs/promises'
import { cpus, loadavg, tmpdir } from 'node:os'
import { join, resolve } from 'node:path'
import { performance } from 'node:perf_hooks'
import { parseArgs } from 'node:util'
import * as ort from 'onnxruntime-node'
import { createOnnxruntimeBackend, createStageRunner, createStaticStageRunner, GREEDY_PICK, stageInfoOf } from '../daemon/engine/index.ts'
import type { BackendSession, StageRunner } from '../daemon/engine/index.ts'
import { compileShards, generateTestModel } from '../shards/index.ts'
import { execWithServeMalloc } from './lib/malloc.ts'

// The engine runs in this process, and in any child that inherits its environment: with `shoal
// serve`'s malloc settings, as served (reproduction/lib/malloc.ts).
execWithServeMalloc()

const { values: args } = parseArgs({
  options: {
    model: { type: 'string' },
    quant: { type: 'string', default: 'int4' },
    ctx: { type: 'string', default: '1024' },
    chunk: { type: 'string', default: '128' },
    contexts: { type: 'string', default: '64,512,960' },
    steps: { type: 'string', default: '40' },
    threads: { type: 'string', default: '2' },
    // MatMulNBits accuracy_level for --quant int4/int8: 4 (int8 activations, the default) or 0 (f32).
    accuracy: { type: 'string', default: '4' },
  },
})
const CTX = Number(args.ctx)
const CHUNK = Number(args.chunk)
const STEPS = Number(args.steps)
const THREADS = Number(args.threads)
const contexts = args.contexts.split(',').map(Number)

let model = args.model
if (model === undefined) {
  model = resolve(import.meta.dirname, '..', '.cache', 'bench', 'llama-60m')
  if (!existsSync(join(model, 'config.json'))) await generateTestModel({ architecture: 'llama', outDir: model, size: '60m' })
}
const work = await mkdtemp(join(tmpdir(), 'shoal-bench-static-'))
try {
  const t0 = performance.now()
  const manifest = await compileShards({ modelDir: model, outDir: join(work, 'shard'), quant: args.quant as 'int4' | 'none', accuracyLevel: args.accuracy === '0' ? 0 : 4, static: { contextLength: CTX, chunk: CHUNK } })
  console.log(`compiled ${manifest.modelId} (${args.quant}${args.quant === 'none' ? '' : `, ${manifest.quantization.kind !== 'none' ? manifest.quantization.activations : ''} activations`}, opSet ${manifest.opSet}, static ${CTX},${CHUNK}) in ${((performance.now() - t0) / 1000).toFixed(1)} s`)
  const st = manifest.stages[0]!
  const path = (rel: string): string => join(work, 'shard', ...rel.split('/'))
  const backend = createOnnxruntimeBackend()
  const opts = { device: 'CPU', threads: THREADS }
  const timedLoad = async (p: string): Promise<[BackendSession, number]> => {
    const t = performance.now()
    const s = await backend.load(p, opts)
    return [s, performance.now() - t]
  }

  // ---- load times
  const loads: string[] = []
  for (const [label, p] of [['dynamic', st.graph], ['static prefill', st.static!.prefill], ['static decode', st.static!.decode]] as const) {
    const [a, first] = await timedLoad(path(p)); await a.close()
    const [b, second] = await timedLoad(path(p)); await b.close()
    loads.push(`| ${label} | ${first.toFixed(0)} | ${second.toFixed(0)} |`)
  }
  {
    const opt = join(work, 'optimized.onnx')
    const base = { executionProviders: ['cpu'], intraOpNumThreads: THREADS, interOpNumThreads: 1, logSeverityLevel: 3 as const }
    let t = performance.now()
    const save = await ort.InferenceSession.create(path(st.graph), {
      ...base, graphOptimizationLevel: 'all', optimizedModelFilePath: opt,
      extra: { session: { optimized_model_external_initializers_file_name: 'optimized.onnx.data', optimized_model_external_initializers_min_size_in_bytes: '1024' } },
    })
    const saving = performance.now() - t
    await save.release()
    const times: number[] = []
    for (let i = 0; i < 2; i++) {
      t = performance.now()
      const s = await ort.InferenceSession.create(opt, { ...base, graphOptimizationLevel: 'disabled' })
      times.push(performance.now() - t)
      await s.release()
    }
    loads.push(`| onnxruntime optimized model file (dynamic; saving it: ${saving.toFixed(0)} ms) | ${times[0]!.toFixed(0)} | ${times[1]!.toFixed(0)} |`)
  }

  // ---- step times
  const [dynSession] = await timedLoad(path(st.graph))
  const [pre] = await timedLoad(path(st.static!.prefill))
  const [dec] = await timedLoad(path(st.static!.decode))
  const info = stageInfoOf(manifest)
  const dynamic = createStageRunner({ session: dynSession, stage: info, chunkSize: CHUNK })
  const fixed = createStaticStageRunner({ prefill: pre, decode: dec, stage: info, contextLength: CTX, chunk: CHUNK })
  const greedy = GREEDY_PICK
  const rows: string[] = []
  let agree = 0
  let compared = 0
  for (const L of contexts) {
    if (L + STEPS > CTX) { console.log(`skipping context ${L}: ${L} + ${STEPS} steps exceed CTX ${CTX}`); continue }
    const prompt = BigInt64Array.from({ length: L }, (_, i) => BigInt((i * 7919 + 13) % manifest.shape.vocabSize))
    const result: Record<string, { prefill: number, step: number, tokens: number[] }> = {}
    for (const [label, r] of [['dynamic', dynamic], ['static', fixed]] as Array<[string, StageRunner]>) {
      r.open('b')
      let t = performance.now()
      let o = await r.step('b', { kind: 'tokens', ids: prompt }, BigInt64Array.from({ length: L }, (_, i) => BigInt(i)), 1, greedy)
      const prefill = performance.now() - t
      const tokens: number[] = []
      t = performance.now()
      for (let s = 0; s < STEPS; s++) {
        if (o.kind !== 'token') throw new Error('token expected')
        tokens.push(o.id)
        o = await r.step('b', { kind: 'tokens', ids: BigInt64Array.of(BigInt(o.id)) }, BigInt64Array.of(BigInt(L + s)), 1, greedy)
      }
      const step = (performance.now() - t) / STEPS
      await r.drop('b', 'free')
      result[label] = { prefill, step, tokens }
    }
    const d = result.dynamic!
    const s = result.static!
    compared += d.tokens.length
    agree += d.tokens.filter((x, i) => x === s.tokens[i]).length
    rows.push(`| ${L} | ${d.step.toFixed(2)} | ${s.step.toFixed(2)} | ${(L / d.prefill * 1000).toFixed(0)} | ${(L / s.prefill * 1000).toFixed(0)} |`)
  }
  await dynSession.close(); await pre.close(); await dec.close()

  console.log(`\n${cpus()[0]?.model ?? 'cpu'} × ${cpus().length}, load average ${loadavg()[0]!.toFixed(2)}, ${THREADS} intra-op threads, Node ${process.versions.node}`)
  console.log(`\n| context | dynamic ms/step | static ms/step (CTX ${CTX}) | dynamic prefill tok/s | static prefill tok/s (CHUNK ${CHUNK}) |\n|---|---|---|---|---|\n${rows.join('\n')}`)
  console.log(`\ngreedy tokens equal: ${agree}/${compared}`)
  console.log(`\n| session load (ms) | first | second |\n|---|---|---|\n${loads.join('\n')}`)
} finally {
  await rm(work, { recursive: true, force: true })
}
