/** The `code` of what `fn` throws (undefined when it does not throw): for typed-error assertions. */
export function codeOf (fn: () => unknown): string | undefined {
  try {
    fn()
  } catch (err) {
    return (err as { code?: string }).code
  }
  return undefined
}
