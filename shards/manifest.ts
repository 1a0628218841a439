/**
 * manifest.json: writing, loading with validation, and verifying every file's size and sha256.
 */
import { createHash } from 'node:crypto'
import { createReadStream } from 'node:fs'
import { readFile, stat, writeFile, rename } from 'node:fs/promises'
import { join, relative, sep } from 'node:path'
import { DECODE_ATTENTION_FORMS, MANIFEST_FILE, MANIFEST_FORMAT, type ShardFile, type ShardManifest } from './contract.ts'
import { ManifestError, ShardIntegrityError } from './errors.ts'

export async function sha256File (file: string): Promise<string> {
  const h = createHash('sha256')
  for await (const chunk of createReadStream(file, { highWaterMark: 1 << 20 })) h.update(chunk as Buffer)
  return h.digest('hex')
}

export async function describeFile (root: string, file: string): Promise<ShardFile> {
  return { path: relative(root, file).split(sep).join('/'), sha256: await sha256File(file), bytes: (await stat(file)).size }
}

export async function writeManifest (dir: string, manifest: ShardManifest): Promise<void> {
  const tmp = join(dir, `${MANIFEST_FILE}.tmp`)
  await writeFile(tmp, JSON.stringify(manifest, null, 2) + '\n')
  await rename(tmp, join(dir, MANIFEST_FILE))
}

function fail (what: string): never {
  throw new ManifestError(`manifest.json: ${what}`)
}

const isInt = (v: unknown): v is number => typeof v === 'number' && Number.isInteger(v)
/** A JSON object (null is not one: `typeof null` is 'object', and reading a field of it throws a TypeError, not a ManifestError). */
const isObj = (v: unknown): v is Record<string, any> => typeof v === 'object' && v !== null && !Array.isArray(v)

function checkFiles (files: unknown, where: string): void {
  if (!Array.isArray(files)) fail(`${where}: files must be an array`)
  for (const f of files as unknown[]) {
    const o = f as Partial<ShardFile>
    if (typeof o?.path !== 'string' || o.path.startsWith('/') || o.path.split('/').includes('..')) fail(`${where}: bad file path ${JSON.stringify(o?.path)}`)
    if (typeof o.sha256 !== 'string' || !/^[0-9a-f]{64}$/.test(o.sha256)) fail(`${where}: bad sha256 for ${o.path}`)
    if (!isInt(o.bytes) || o.bytes < 0) fail(`${where}: bad size for ${o.path}`)
  }
}

/** Structural checks: format, shape, stages contiguous from layer 0 to the last layer. */
export function validateManifest (m: unknown): ShardManifest {
  const o = m as Partial<ShardManifest>
  if (!isObj(o)) fail('not an object')
  if (o.format !== MANIFEST_FORMAT) fail(`format ${JSON.stringify(o.format)}, expected ${MANIFEST_FORMAT}`)
  if (typeof o.modelId !== 'string' || o.modelId === '') fail('modelId missing')
  if (typeof o.sourceHash !== 'string') fail('sourceHash missing')
  const s = o.shape
  if (!isObj(s)) fail('shape missing')
  for (const k of ['hiddenSize', 'numLayers', 'numHeads', 'numKvHeads', 'headDim', 'intermediateSize', 'vocabSize', 'maxPositions'] as const) {
    if (!isInt(s[k]) || s[k] <= 0) fail(`shape.${k} must be a positive integer`)
  }
  if (s.moe !== undefined) {
    const e = s.moe
    if (!isObj(e)) fail('shape.moe must be an object')
    if (!isInt(e.numExperts) || e.numExperts <= 0 || !isInt(e.topK) || e.topK <= 0 || e.topK > e.numExperts) fail('shape.moe: topK must be 1..numExperts')
    if (!isInt(e.expertIntermediateSize) || e.expertIntermediateSize <= 0 || !isInt(e.sharedExpertIntermediateSize) || e.sharedExpertIntermediateSize < 0) fail('shape.moe: bad expert widths')
    if (!Array.isArray(e.moeLayers) || e.moeLayers.some((l, i) => !isInt(l) || l < 0 || l >= s.numLayers || (i > 0 && l <= e.moeLayers[i - 1]!))) fail('shape.moe.moeLayers must be ascending layer indices')
  }
  const q = o.quantization
  if (!isObj(q) || !['none', 'int8', 'int4'].includes(q.kind)) fail('quantization.kind must be none, int8 or int4')
  if (q.kind !== 'none' && q.blockSize !== 32 && q.blockSize !== 128) fail('quantization.blockSize must be 32 or 128')
  if (q.kind !== 'none' && q.activations !== undefined && q.activations !== 'int8' && q.activations !== 'f32') fail('quantization.activations must be int8 or f32')
  if (q.kind !== 'none' && q.embedding !== undefined && q.embedding !== 'f32' && !(q.embedding === 'int4' && q.kind === 'int4')) fail('quantization.embedding must be f32, or int4 in int4 shards')
  if (q.kind !== 'none' && q.kernel !== undefined && !(q.kernel === 'native' && q.kind === 'int4' && q.blockSize === 32 && q.activations !== 'f32')) {
    fail("quantization.kernel must be 'native', in int4 shards of block 32 with int8 activations")
  }
  if (o.decodeAttention !== undefined && !DECODE_ATTENTION_FORMS.includes(o.decodeAttention)) fail(`decodeAttention must be ${DECODE_ATTENTION_FORMS.join(' or ')}`)
  if (!isObj(o.generation) || !Array.isArray(o.generation.eosTokenIds)) fail('generation.eosTokenIds missing')
  checkFiles(o.tokenizerFiles, 'tokenizerFiles')
  if (!Array.isArray(o.stages) || o.stages.length === 0) fail('no stages')
  let next = 0
  o.stages.forEach((st, i) => {
    if (!isObj(st)) fail(`stage ${i}: not an object`)
    if (st.index !== i) fail(`stage ${i}: index ${JSON.stringify(st.index)}`)
    if (!Array.isArray(st.layers) || !isInt(st.layers[0]) || !isInt(st.layers[1]) || st.layers[0] !== next || st.layers[1] < st.layers[0]) {
      fail(`stage ${i}: layers ${JSON.stringify(st.layers)} do not continue from layer ${next}`)
    }
    next = st.layers[1] + 1
    if (st.hasEmbedding !== (i === 0)) fail(`stage ${i}: hasEmbedding must be ${i === 0}`)
    if (st.hasHead !== (i === o.stages!.length - 1)) fail(`stage ${i}: hasHead must be ${i === o.stages!.length - 1}`)
    if (typeof st.graph !== 'string' || typeof st.dir !== 'string') fail(`stage ${i}: graph/dir missing`)
    checkFiles(st.files, `stage ${i}`)
    if (!st.files.some(f => f.path === st.graph)) fail(`stage ${i}: graph ${st.graph} not among its files`)
    if (st.decodeGraph !== undefined) {
      if (typeof st.decodeGraph !== 'string' || !st.files.some(f => f.path === st.decodeGraph)) fail(`stage ${i}: decodeGraph ${JSON.stringify(st.decodeGraph)} not among its files`)
      if (o.opSet !== 'ort-contrib') fail(`stage ${i}: a decodeGraph belongs to 'ort-contrib' shards only`)
    }
    if (st.static !== undefined || o.static !== undefined) {
      if (o.static === undefined) fail(`stage ${i}: static graphs without a top-level static`)
      for (const g of [st.static?.prefill, st.static?.decode]) {
        if (typeof g !== 'string' || !st.files.some(f => f.path === g)) fail(`stage ${i}: static graph ${JSON.stringify(g)} missing or not among its files`)
      }
    }
  })
  if (o.static !== undefined) {
    if (!isObj(o.static)) fail('static must be an object')
    const { contextLength: ctx, chunk } = o.static
    if (!isInt(ctx) || ctx < 2 || ctx > s.maxPositions) fail(`static.contextLength must be an integer in 2..${s.maxPositions}`)
    if (!isInt(chunk) || chunk < 1 || chunk > ctx) fail('static.chunk must be an integer in 1..static.contextLength')
    if (o.static.opSet !== 'standard') fail('static.opSet must be standard')
  }
  if (next !== s.numLayers) fail(`stages cover layers 0..${next - 1}, model has ${s.numLayers}`)
  return o as ShardManifest
}

export async function loadManifest (shardDir: string): Promise<ShardManifest> {
  let text: string
  try {
    text = await readFile(join(shardDir, MANIFEST_FILE), 'utf8')
  } catch (err) {
    throw new ManifestError(`${shardDir}: no readable ${MANIFEST_FILE}`, { cause: err })
  }
  let parsed: unknown
  try {
    parsed = JSON.parse(text)
  } catch (err) {
    throw new ManifestError(`${shardDir}/${MANIFEST_FILE}: not JSON`, { cause: err })
  }
  return validateManifest(parsed)
}

/** Checks size and sha256 of every file the manifest lists (or only those of some stages). */
export async function verifyShardFiles (shardDir: string, manifest: ShardManifest, stages?: number[]): Promise<void> {
  const files = [
    ...manifest.tokenizerFiles,
    ...manifest.stages.filter(s => stages === undefined || stages.includes(s.index)).flatMap(s => s.files),
  ]
  for (const f of files) {
    const path = join(shardDir, ...f.path.split('/'))
    let size: number
    try {
      size = (await stat(path)).size
    } catch {
      throw new ShardIntegrityError(f.path, 'missing')
    }
    if (size !== f.bytes) throw new ShardIntegrityError(f.path, `size ${size}, manifest says ${f.bytes}`)
    const digest = await sha256File(path)
    if (digest !== f.sha256) throw new ShardIntegrityError(f.path, `sha256 ${digest}, manifest says ${f.sha256}`)
  }
}

/**
 * The manifest hash: sha256 (hex) of the manifest.json bytes as written. It names one exact
 * compilation in capability gossip, chain formation and receipts, and anyone can check it with
 * `sha256sum manifest.json`.
 */
export async function manifestHash (shardDir: string): Promise<string> {
  return await sha256File(join(shardDir, MANIFEST_FILE))
}
