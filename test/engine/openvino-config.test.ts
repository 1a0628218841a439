/**
 * The OpenVINO backend's compile properties (pure: testable where openvino-node's runtime cannot
 * install): CACHE_DIR under the node's compiled-model cache when it has one, f32 precision and a
 * thread count on CPU, the latency hint everywhere.
 */
import { join } from 'node:path'
import { describe, expect, it } from 'vitest'
import { compiledCacheDir, openvinoCacheDir, openvinoCompileConfig } from '../../daemon/engine/index.ts'

describe('openvino compile config', () => {
  const cacheDir = compiledCacheDir('/var/cache/shoal')

  it('puts CACHE_DIR in the node cache root\'s compiled/openvino, for every device', () => {
    expect(cacheDir).toBe(join('/var/cache/shoal', 'compiled'))
    for (const device of ['CPU', 'GPU', 'NPU', 'AUTO']) {
      expect(openvinoCompileConfig({ device, cacheDir }).CACHE_DIR).toBe(join('/var/cache/shoal', 'compiled', 'openvino'))
    }
    expect(openvinoCacheDir(cacheDir)).toBe(join('/var/cache/shoal', 'compiled', 'openvino'))
  })

  it('caches nothing without a cache directory; CPU keeps f32 and its thread count', () => {
    expect(openvinoCompileConfig({ device: 'NPU' })).toEqual({ PERFORMANCE_HINT: 'LATENCY' })
    expect(openvinoCompileConfig({ device: 'CPU', threads: 3, cacheDir })).toEqual({
      PERFORMANCE_HINT: 'LATENCY', CACHE_DIR: join(cacheDir, 'openvino'), INFERENCE_NUM_THREADS: 3, INFERENCE_PRECISION_HINT: 'f32',
    })
  })
})
