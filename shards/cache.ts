/**
 * On-disk caches under a daemon's cache root: the demo checkpoint (generated once) and compiled
 * shards of HF checkpoints keyed by the checkpoint's content hash. Both are built in a temp dir
 * and renamed into place, so a crash or a concurrent daemon never leaves a half-written entry.
 */
import { randomBytes } from 'node:crypto'
import { existsSync } from 'node:fs'
import { mkdir, rename, rm } from 'node:fs/promises'
import { join, resolve } from 'node:path'
import { checkpointHash } from './checkpoint.ts'
import { compileShards, COMPILER_VERSION } from './compile.ts'
import { MANIFEST_FILE } from './contract.ts'
import { loadManifest } from './manifest.ts'
import { generateTestModel, type TestArchitecture, type TestModelSize } from './testmodel/generate.ts'

/** Bump when the demo checkpoint's generator output changes. */
const DEMO_VERSION = 2
export const DEMO_MODEL_ID = 'shoal-demo'

export function isShardDir (dir: string): boolean {
  return existsSync(join(dir, MANIFEST_FILE))
}

async function publish (tmp: string, dest: string): Promise<void> {
  try {
    await rename(tmp, dest)
  } catch (err) {
    const code = (err as NodeJS.ErrnoException).code
    // Someone else published the same entry first: theirs is as good as ours.
    if ((code === 'ENOTEMPTY' || code === 'EEXIST') && existsSync(dest)) { await rm(tmp, { recursive: true, force: true }); return }
    throw err
  }
}

const tmpName = (parent: string, what: string): string => join(parent, `.tmp-${what}-${process.pid}-${randomBytes(4).toString('hex')}`)

export interface DemoOptions {
  architecture?: TestArchitecture
  size?: TestModelSize
  /** Called once when the checkpoint has to be generated (not when it is already cached). */
  onGenerate?: (dir: string) => void
}

/** What a cache fill reports: only a cache miss calls these. */
export interface CompileCacheProgress {
  /** The compile starts (the checkpoint, the cache entry it fills). */
  onCompile?: (modelDir: string, dest: string) => void
  /** Layers compiled so far, of all. */
  onProgress?: (done: number, total: number) => void
}

/**
 * The demo checkpoint (random weights, real HF layout; model id "shoal-demo"), generated once
 * into cacheRoot/models/ and reused. Returns its directory.
 */
export async function ensureDemoModel (cacheRoot: string, options: DemoOptions = {}): Promise<string> {
  const arch = options.architecture ?? 'llama'
  const size = options.size ?? 'demo'
  const parent = join(resolve(cacheRoot), 'models')
  const dest = join(parent, `demo-${arch}-${size}-v${DEMO_VERSION}`)
  if (existsSync(join(dest, 'config.json'))) return dest
  await mkdir(parent, { recursive: true })
  const tmp = tmpName(parent, 'demo')
  options.onGenerate?.(dest)
  try {
    await generateTestModel({
      architecture: arch,
      size,
      outDir: tmp,
      seed: 1,
      modelId: DEMO_MODEL_ID,
      description: `random weights (shoal demo model: ${arch} ${size}, seed 1) — not a trained model; its text is noise`,
    })
    await publish(tmp, dest)
  } catch (err) {
    await rm(tmp, { recursive: true, force: true })
    throw err
  }
  return dest
}

/**
 * One-stage fp32 shards of an HF checkpoint, compiled once into cacheRoot/shards/<sourceHash>
 * and reused while the checkpoint's content and the compiler version are unchanged.
 */
export async function compileCached (modelDir: string, cacheRoot: string, progress: CompileCacheProgress = {}): Promise<string> {
  const hash = await checkpointHash(modelDir)
  const parent = join(resolve(cacheRoot), 'shards')
  const dest = join(parent, hash)
  if (isShardDir(dest)) {
    try {
      const m = await loadManifest(dest)
      if (m.compilerVersion === COMPILER_VERSION && m.sourceHash === hash) return dest
    } catch { /* unreadable or stale: rebuild below */ }
  }
  await mkdir(parent, { recursive: true })
  const tmp = tmpName(parent, hash.slice(0, 12))
  progress.onCompile?.(modelDir, dest)
  try {
    await compileShards({ modelDir, outDir: tmp, ...(progress.onProgress === undefined ? {} : { onProgress: progress.onProgress }) })
    if (existsSync(dest)) {
      // A stale entry from another compiler version: move it aside, then publish ours.
      const old = tmpName(parent, 'stale')
      await rename(dest, old).catch(() => {})
      await rm(old, { recursive: true, force: true })
    }
    await publish(tmp, dest)
  } catch (err) {
    await rm(tmp, { recursive: true, force: true })
    throw err
  }
  return dest
}
