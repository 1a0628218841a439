/**
 * `shoal shard`: compile a Hugging Face checkpoint into per-stage ONNX shards and a manifest.
 */
import { existsSync } from 'node:fs'
import { readdir, rm } from 'node:fs/promises'
import { ExitError } from '../exit-error.ts'

export interface ShardCommandOptions {
  model: string
  out: string
  stages?: string
  layers?: string
  quant?: string
  f32Activations?: boolean
  f32Embedding?: boolean
  ops?: string
  static?: string
  force?: boolean
  experts?: boolean
}

/** An --out that holds anything is refused unless --force: a typo must not eat a directory. */
async function checkOut (out: string, force: boolean): Promise<void> {
  if (!existsSync(out)) return
  const entries = await readdir(out).catch(() => { throw new ExitError(`--out ${out} exists and is not a directory`) })
  if (entries.length === 0) return
  if (!force) throw new ExitError(`--out ${out} already exists and is not empty; pass --force to replace it`)
  await rm(out, { recursive: true, force: true })
}

export async function shard (opts: ShardCommandOptions): Promise<void> {
  const { compileShards, createProgress, parseLayerRanges } = await import('../../shards/index.ts')
  if (!existsSync(opts.model)) throw new ExitError(`--model ${opts.model} does not exist`)
  const quant = opts.quant ?? 'none'
  if (quant !== 'none' && quant !== 'int8' && quant !== 'int4') throw new ExitError(`--quant must be none, int8 or int4, got ${quant}`)
  if (opts.f32Activations === true && quant === 'none') throw new ExitError('--f32-activations needs --quant int8 or int4')
  if (opts.f32Embedding === true && quant !== 'int4') throw new ExitError('--f32-embedding needs --quant int4 (only int4 quantizes the embedding)')
  const ops = opts.ops ?? 'ort-contrib'
  if (ops !== 'ort-contrib' && ops !== 'standard') throw new ExitError(`--ops must be ort-contrib or standard, got ${ops}`)
  let stages: number | undefined
  if (opts.stages !== undefined) {
    stages = Number(opts.stages)
    if (!Number.isInteger(stages) || stages < 1) throw new ExitError(`--stages must be a positive integer, got ${opts.stages}`)
  }
  const fixed = opts.static === undefined ? undefined : parseStatic(opts.static)
  if (opts.experts === true && (stages !== undefined || opts.layers !== undefined || fixed !== undefined || opts.ops !== undefined && opts.ops !== 'ort-contrib')) {
    throw new ExitError('--experts writes expert-parallel shards (standard ops, one piece per layer and expert): --stages, --layers, --static and --ops do not apply')
  }
  await checkOut(opts.out, opts.force === true)
  try {
    if (opts.experts === true) {
      const { compileExpertShards } = await import('../../shards/index.ts')
      const l = await compileExpertShards({ modelDir: opts.model, outDir: opts.out, quant, ...(opts.f32Activations === true ? { accuracyLevel: 0 as const } : {}), ...(opts.f32Embedding === true ? { embedding: 'f32' as const } : {}) })
      const moe = l.shape.moe!
      process.stdout.write(`${l.modelId}: ${l.shape.architecture}, ${l.shape.numLayers} layers, ${moe.moeLayers.length} MoE layers × ${moe.numExperts} experts (top-${moe.topK}), quant ${l.quantization.kind}, expert-parallel → ${opts.out}\n`)
      return
    }
    const layers = opts.layers !== undefined ? parseLayerRanges(opts.layers) : undefined
    let timed = ''
    const m = await compileShards({
      modelDir: opts.model,
      outDir: opts.out,
      quant,
      opSet: ops,
      // The one-position attention's form this CPU runs faster (kernel-probe.ts): shards compiled
      // here for other machines take this machine's choice; both forms give the same tokens. A
      // failed probe costs speed, not the compile: the per-head form of compilers 7–11.
      decodeAttention: async (shape) => {
        const { decodeAttentionOrPerHead } = await import('../../daemon/engine/index.ts')
        const c = await decodeAttentionOrPerHead(shape)
        timed = c.error === undefined
          ? `, ${c.form} one-position attention (grouped/per-head ${c.ratio.toFixed(2)} here)`
          : `, per-head one-position attention (the probe failed: ${c.error})`
        return c.form
      },
      onProgress: createProgress((line) => { process.stderr.write(`shoal: ${line}\n`) }, `compiling ${opts.model}`),
      ...(opts.f32Activations === true ? { accuracyLevel: 0 as const } : {}),
      ...(opts.f32Embedding === true ? { embedding: 'f32' as const } : {}),
      ...(stages !== undefined ? { stages } : {}),
      ...(layers !== undefined ? { layers } : {}),
      ...(fixed !== undefined ? { static: fixed } : {}),
    })
    const ranges = m.stages.map(s => `${s.layers[0]}-${s.layers[1]}`).join(', ')
    const fixedNote = m.static === undefined ? '' : `, static graphs ctx ${m.static.contextLength} chunk ${m.static.chunk}`
    process.stdout.write(`${m.modelId}: ${m.shape.architecture}, ${m.shape.numLayers} layers, ${m.stages.length} stage(s) [${ranges}], quant ${m.quantization.kind}${timed}${fixedNote} → ${opts.out}\n`)
  } catch (err) {
    const code = (err as { code?: unknown }).code
    // Expected failures (bad checkpoint, unsupported architecture, bad split) are the user's to fix: exit 2 with the reason.
    if (typeof code === 'string' && code.startsWith('SHOAL_ERR_')) throw new ExitError(`shard: ${(err as Error).message}`)
    throw err
  }
}

/** `--static CTX[,CHUNK]`: positive integers (the compiler checks them against the model). */
export function parseStatic (text: string): { contextLength: number, chunk?: number } {
  const m = /^(\d+)(?:,(\d+))?$/.exec(text.trim())
  if (m === null) throw new ExitError(`--static must be CTX or CTX,CHUNK (positive integers), got ${text}`)
  const contextLength = Number(m[1])
  return m[2] === undefined ? { contextLength } : { contextLength, chunk: Number(m[2]) }
}
