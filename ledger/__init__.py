"""inference-ledger: an audit-trail ledger for LLM inference.

The package never imports torch: the replay engine lives in the separate ``workers``
package, which the CLI loads lazily.
"""

__version__ = "0.1.0"
